"""The codec's C kernels (kvstore.core.native): the eager codec's bytes and decoded bits on
every INT8 scheme, dtype and odd shape, refusals where they do not apply, and bad KV
refused as the eager path refuses it. Every test runs once per instruction set the kernels
can use (AVX2, and AVX-512 where the CPU has it), encode and decode alike."""

from __future__ import annotations

import os
import platform
import signal
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.core import codec, fused, native
from kvstore.core.codec import ChunkKey, decode_chunk, encode_blocks, encode_chunk
from kvstore.core.kvgen import realistic_kv
from kvstore.errors import InvalidArgument

INT8 = ["int8-kc-vt", "int8-kt-vt", "int8-kcc-vt", "int8-kcc-vct"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _cpu_can() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c"))


def _cpu_has_avx512_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    need = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
    return _cpu_can() and all(f" {flag}" in flags for flag in need)


BUILT_TEST = "test_built_wherever_the_cpu_can_run_them"


@pytest.fixture(autouse=True, params=native.ISAS)
def _restore_mode(request: pytest.FixtureRequest) -> Iterator[None]:
    if not native.available():
        if request.node.originalname == BUILT_TEST and request.param == "avx2":
            yield  # (runs once, to fail where the build lost the kernels)
            return
        pytest.skip("codec C kernels not built here")
    if native.set_isa(request.param) != request.param:
        pytest.skip(f"this CPU has no {request.param}")
    try:
        yield
    finally:
        fused.set_mode(None)
        native.set_isa("auto")


def test_built_wherever_the_cpu_can_run_them() -> None:
    # never skipped for want of the extension: a build that lost it fails here
    if not _cpu_can():
        pytest.skip("not an x86-64 CPU with AVX2, FMA and F16C")
    assert native.available()
    # and decode takes AVX-512 exactly where the CPU has it
    assert native.set_isa("auto") == ("avx512" if _cpu_has_avx512_bf16() else "avx2")


def _keys(n: int) -> list[ChunkKey]:
    return [ChunkKey(bytes([i + 1]) * 16, 3, 1) for i in range(n)]


def _encode(mode: str, layer: torch.Tensor | tuple[torch.Tensor, torch.Tensor], block: int,
            n: int, quant: str) -> torch.Tensor:  # fmt: skip
    fused.set_mode(mode)
    return torch.stack([r.clone() for r in encode_blocks(layer, block, _keys(n), quant=quant)])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _decode(mode: str, rows: torch.Tensor, out: torch.Tensor, block: int) -> None:
    fused.set_mode(mode)
    for i in range(rows.shape[0]):
        decode_chunk(rows[i], out=out[:, i * block : (i + 1) * block])


def _same_both_ways(layer: torch.Tensor, block: int, n: int, quant: str) -> None:
    """Native and eager give one encoding and one decoding (bit for bit), into strided
    slices of a wider layer."""
    eager, fast = (
        _encode("eager", layer, block, n, quant),
        _encode("native", layer, block, n, quant),
    )
    assert torch.equal(eager, fast), f"{quant} {layer.dtype} {tuple(layer.shape)}"
    outs = {}
    for mode in ("eager", "native"):
        wide = torch.full((2, n * block + 3, *layer.shape[2:]), 7.0, dtype=layer.dtype)
        _decode(mode, eager, wide[:, 1:], block)
        outs[mode] = wide
    assert torch.equal(_bits(outs["eager"]), _bits(outs["native"]))
    assert (outs["native"][:, 0] == 7).all() and (outs["native"][:, n * block + 1 :] == 7).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    quant=st.sampled_from(INT8),
    dtype=st.sampled_from(DTYPES),
    block=st.integers(1, 9),
    n=st.integers(1, 4),
    h=st.integers(1, 3),
    d=st.sampled_from([8, 16, 24, 40, 64, 136, 9, 12, 15, 17, 30, 50, 100, 130, 255]),
    seed=st.integers(0, 2**16),
    loud=st.sampled_from([1.0, 1e-6, 30.0, 3e3]),
)
def test_the_eager_bytes_on_every_scheme_dtype_and_shape(
    quant: str, dtype: torch.dtype, block: int, n: int, h: int, d: int, seed: int, loud: float
) -> None:
    x = realistic_kv(n * block + 2, h, d, torch.float32, seed=seed)
    x[0, :, 0, 1] *= loud  # one channel far louder (or quieter) than the rest
    x[0, :, -1, -1] += 40.0  # a K channel with a large offset (what centring is for)
    x[1, ::3, 0] = 0.0  # zero tokens
    _same_both_ways(x.to(dtype)[:, 1:], block, n, quant)


@pytest.mark.parametrize("quant", INT8)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_eager_bytes_at_engine_shapes(quant: str, dtype: torch.dtype) -> None:
    # 16-token blocks of a trace-like layer, and one 256-token block: H=8, D=128
    _same_both_ways(realistic_kv(48, 8, 128, dtype, seed=5), 16, 3, quant)
    _same_both_ways(realistic_kv(256, 8, 128, dtype, seed=6), 256, 1, quant)


ODD_D = [9, 15, 17, 30, 50, 100, 250, 255]
"""Head dims that 8 (encode's vector) or 16 (decode's) does not divide: under 16 (decode's
8-wide rows), just over a vector, and the last vector overlapping by 1 to 15 channels."""


def _ran_native(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """What each call of native.quantize and native.dequantize returned from now on, and
    each chunk the decode kernels ran for (``decode_at``: from ``dequantize``, or straight
    from the codec for a header form it met before)."""
    calls: list[tuple[str, bool]] = []
    for name in ("quantize", "dequantize", "decode_at"):
        real = getattr(native, name)

        def spy(*args: object, _real: Any = real, _name: str = name) -> bool:
            ran: bool = _real(*args) is not False  # (decode_at returns None)
            calls.append((_name, ran))
            return ran

        monkeypatch.setattr(native, name, spy)
    return calls


@pytest.mark.parametrize("quant", INT8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", ODD_D)
def test_a_head_dim_off_the_vector_width_gives_the_eager_bytes(
    quant: str, dtype: torch.dtype, d: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each row's last vector overlaps the one before it: the eager bytes and bits, from the
    kernels, and nothing written past a head's last channel."""
    block, n, h = 5, 3, 3
    x = realistic_kv(n * block + 1, h, d, torch.float32, seed=d)
    x[0, :, 1, -1] += 25.0  # a K channel with a large offset, in the last vector only
    x[1, 4, 2, -1] = 9.0  # a loud last channel: its token's scale
    x[0, 7, 0, -2] = -9.0  # and a loud negative one beside it
    layer = x.to(dtype)[:, 1:]
    _same_both_ways(layer, block, n, quant)
    calls = _ran_native(monkeypatch)
    rows = _encode("native", layer, block, n, quant)
    outs = {}
    for mode in ("eager", "native"):  # heads of a wider layer: channels D.. keep their 7s
        wide = torch.full((2, n * block, h, d + 5), 7.0, dtype=dtype)
        _decode(mode, rows, wide[..., :d], block)
        outs[mode] = wide
    assert torch.equal(_bits(outs["eager"]), _bits(outs["native"]))
    assert (outs["native"][..., d:] == 7).all()
    # the kernels encoded and decoded each chunk (in the eager mode they decline)
    assert calls[0] == ("quantize", True)
    assert [c for c in calls if c[0] == "dequantize" and not c[1]] == [("dequantize", False)] * n
    assert calls.count(("decode_at", True)) == n


@pytest.mark.parametrize("quant", INT8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [9, 12, 16, 20])
def test_many_heads_give_the_eager_bytes(quant: str, dtype: torch.dtype, h: int) -> None:
    """A token's heads are encoded 8 at a time (their per-token scales in one vector): more
    than 8 heads, in whole groups and with a short last one."""
    x = realistic_kv(33, h, 100, torch.float32, seed=h)
    x[1, 5, h - 1] *= 50.0  # a loud head in the last group
    x[1, 6, 8] = 0.0  # a zero head: the 2**-14 floor
    _same_both_ways(x.to(dtype)[:, 1:], 16, 2, quant)


@pytest.mark.parametrize("quant", INT8)
def test_an_odd_head_dim_gives_the_eager_bytes_over_several_tiles(quant: str) -> None:
    """Blocks of 512 tokens at D=250 in float32: each block's heads in two tiles of the
    encode (_native.c's TILE_BYTES), decoded into a slice of a layer."""
    block, n, h, d = 512, 2, 3, 250
    assert block * d * 4 * h > 1 << 20  # more than one tile of 1 MiB
    x = realistic_kv(n * block + 1, h, d, torch.float32, seed=3)
    x[0, :, 2, -3] += 25.0
    _same_both_ways(x[:, 1:], block, n, quant)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_values_give_the_eager_bytes(dtype: torch.dtype) -> None:
    x = realistic_kv(16, 2, 16, torch.float32, seed=9)
    x[0, :, 0, 0] = 0.0  # an all-zero channel
    x[1, 2] = 0.0  # an all-zero token
    x[0, :, 1, 2] = 1e-3 * torch.arange(16)  # a tiny, spread channel
    x[:, 3] *= 0.004  # a quiet token: per-token scales just above the 2**-14 floor
    x[1, 5, 1] = 6e4  # a loud token (the channel maxima are float16: no more)
    if dtype != torch.float16:
        x[0, :, 1, 3] = 1e-30  # below float16's range: scales floor at 2**-14
    for quant in INT8:
        _same_both_ways(x.to(dtype), 4, 4, quant)


@pytest.mark.parametrize("quant", INT8)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 3e38])
@pytest.mark.parametrize(("d", "channel"), [(16, 9), (30, 29), (12, 11), (128, 70), (80, 75)])
def test_bad_kv_is_refused_as_eager_refuses_it(
    quant: str, bad: float, d: int, channel: int
) -> None:
    # (D=30, 12: in the channels only a row's last, overlapping vector reads; D=128: in
    # AVX-512's 64 codes to a store, D=80: in its 16 after them)
    for half in (0, 1):
        x = realistic_kv(8, 2, d, torch.float32, seed=2)
        x[half, 5, 1, channel] = bad
        fused.set_mode("native")
        with pytest.raises(InvalidArgument, match="NaN/inf"):
            encode_chunk(x, quant, key=_keys(1)[0])


def test_k_and_v_apart_and_one_chunk() -> None:
    x = realistic_kv(32, 4, 64, torch.bfloat16, seed=3)
    k, v = x[0].clone(), x[1].clone()  # a (K, V) pair of separate tensors
    assert torch.equal(
        _encode("eager", (k, v), 8, 4, "int8"), _encode("native", (k, v), 8, 4, "int8")
    )
    fused.set_mode("eager")
    one = encode_chunk(x[:, :8], key=_keys(1)[0])
    fused.set_mode("native")
    assert torch.equal(one, encode_chunk(x[:, :8], key=_keys(1)[0]))


def test_where_they_do_not_apply_the_codec_still_encodes() -> None:
    x = realistic_kv(8, 2, 6, torch.float16, seed=4)  # D=6: less than the kernels' 8
    fused.set_mode("native")
    rows = encode_blocks(x, 4, _keys(2))
    codes = torch.empty(2, 2, 4, 2, 6, dtype=torch.int8)
    assert not native.quantize(x[0][:8].view(2, 4, 2, 6), x[1][:8].view(2, 4, 2, 6), codes,
                               ([], []), ("cc", "ct"))  # fmt: skip
    fused.set_mode("eager")
    assert torch.equal(torch.stack(list(rows)), torch.stack(list(encode_blocks(x, 4, _keys(2)))))


def test_the_eager_mode_turns_them_off() -> None:
    x = realistic_kv(8, 2, 16, torch.float16, seed=4)
    k, v = x[0].view(2, 4, 2, 16), x[1].view(2, 4, 2, 16)
    codes = torch.zeros(2, 2, 4, 2, 16, dtype=torch.int8)
    fused.set_mode("eager")
    assert not native.quantize(k, v, codes, ([], []), ("c", "t"))
    fused.set_mode("fused")
    assert not native.quantize(k, v, codes, ([], []), ("c", "t"))
    assert (codes == 0).all()


def test_a_chunk_decodes_the_same_through_either_path_after_a_round_trip() -> None:
    # decode_chunk with no out: a fresh tensor; values within one scale step per element
    x = realistic_kv(64, 8, 128, torch.float16, seed=8)
    fused.set_mode("native")
    chunk = encode_chunk(x, key=_keys(1)[0])
    got = decode_chunk(chunk)
    fused.set_mode("eager")
    assert torch.equal(_bits(got), _bits(decode_chunk(chunk)))
    assert (got.float() - x.float()).abs().max() < 0.05 * x.float().abs().max()
    assert codec.read_header(chunk).scheme == codec.DEFAULT_INT8


def test_a_big_layer_runs_k_and_v_on_two_threads_with_the_same_bytes() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = realistic_kv(512, 8, 128, torch.bfloat16, seed=11)  # halves of 1 MiB
        assert x[0].numel() * 2 >= native.PARALLEL_BYTES
        _same_both_ways(x, 256, 2, "int8")
        assert native._helper is not None  # the second thread ran a half
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("quant", INT8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [0x7E00, 0x7C00, 0xFC00])  # NaN, inf, -inf
@pytest.mark.parametrize(
    ("d", "which"), [(24, "each"), (32, "each"), (32, "token"), (30, "each"), (100, "token")]
)
def test_a_crafted_chunk_with_a_non_finite_scale_decodes_as_eager_does(
    quant: str, dtype: torch.dtype, bits: int, d: int, which: str
) -> None:
    # any writer can seal such a chunk with a valid checksum: NaN and inf decode as eager's.
    # "each": one scale in each of the chunk's scale tensors; "token": only in the
    # per-token ones (the channels stay finite: D=32 then takes AVX-512 rows where it can,
    # but for the rows with that scale)
    x = realistic_kv(16, 2, d, dtype, seed=12)
    chunk = encode_chunk(x, quant, key=_keys(1)[0]).numpy().copy()
    layout = codec._layout(16, 2, d, dtype, codec.SCHEMES[quant])
    for _, dims, _, at in layout.scale_slots:
        if which == "token" and dims[-1] != 1:
            continue  # a per-channel scale tensor
        struct.pack_into("<H", chunk, codec.HEADER_NBYTES + 2 * (at + 1), bits)
    end = layout.checksum_offset
    struct.pack_into("<Q", chunk, end, xxhash.xxh3_64_intdigest(chunk[:end].data))
    outs = {}
    for mode in ("eager", "native"):
        fused.set_mode(mode)
        outs[mode] = decode_chunk(torch.from_numpy(chunk))
    assert torch.equal(_bits(outs["eager"]), _bits(outs["native"]))
    assert not torch.isfinite(outs["native"].float()).all()


def test_a_zero_k_channel_of_both_signs_stores_a_positive_zero_mid() -> None:
    # amax and amin keep one zero or the other depending on the shape; every path stores +0
    x = torch.zeros(2, 2, 1, 8)
    x[0, 1, 0, 0] = -0.0
    x[0, 0, 0, 1], x[0, 1, 0, 1] = -0.0, 0.0
    for dtype in DTYPES:
        for quant in ("int8-kcc-vt", "int8-kcc-vct"):
            eager = _encode("eager", x.to(dtype), 2, 1, quant)
            assert torch.equal(eager, _encode("native", x.to(dtype), 2, 1, quant))
            mid = eager[0, codec.HEADER_NBYTES : codec.HEADER_NBYTES + 16].view(torch.int16)
            assert (mid == 0).all()  # +0.0, never 0x8000


def test_more_channels_than_the_kernels_take_fall_back_to_eager() -> None:
    x = torch.randn(2, 1, 264, 4096).half()  # H*D over 2**20
    for quant in ("int8-kc-vt", "int8"):
        fused.set_mode("eager")
        eager = encode_chunk(x, quant)
        fused.set_mode("native")
        assert torch.equal(eager, encode_chunk(x, quant))
        assert torch.equal(_bits(decode_chunk(eager)), _bits(decode_chunk(eager)))


def test_an_output_with_a_zero_stride_is_refused_as_eager_refuses_it() -> None:
    chunk = encode_chunk(realistic_kv(4, 2, 16, torch.float32, seed=1))
    for mode in ("eager", "native"):
        fused.set_mode(mode)
        k = torch.zeros(1, 2, 16).expand(4, 2, 16)  # four tokens on one row of memory
        with pytest.raises(RuntimeError, match="more than one element"):
            decode_chunk(chunk, out=(k, torch.empty(4, 2, 16)))


def test_a_forked_child_encodes_a_big_layer() -> None:
    # the helper thread does not survive fork(); the child gets a new one
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = realistic_kv(256, 8, 128, torch.bfloat16, seed=13)
        fused.set_mode("native")
        want = encode_chunk(x)
        assert native._helper is not None
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only with the parent's bytes (numpy compares:
            # torch ops on two threads can hang in a forked child, whatever the codec does)
            same = encode_chunk(x).numpy().tobytes() == want.numpy().tobytes()
            os._exit(0 if same else 1)
        for _ in range(600):  # 60 s at most
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in its first big encode")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(threads)

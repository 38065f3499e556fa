"""The fused (compiled) codec kernels: the eager codec's bytes, the switch, the fallback.

Compiling is slow on a 2-core box (~3-12 s a graph), so every test here reuses the same
four graphs: the block shape of the pinned vectors (T=4, H=2, D=8), as a multi-block
bfloat16 ``int8-kcc-vct`` encode (block count dynamic: hypothesis draws it), a one-block
float16 ``int8-kc-vt`` encode, and their two decodes; together they cover every
quantization mode (c, cc, t, ct).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.core import codec, fused
from kvstore.core.codec import ChunkKey, decode_chunk, encode_blocks, encode_chunk
from kvstore.core.kvgen import realistic_kv
from tests.test_codec import KEY, PINNED, _pinned_kv

T, H, D = 4, 2, 8
MULTI = (torch.bfloat16, "int8-kcc-vct")  # encode_blocks with N >= 2 blocks
SINGLE = (torch.float16, "int8-kc-vt")  # encode_chunk


@pytest.fixture
def mode() -> Iterator[Any]:
    """Run the test under a chosen mode; restore the environment's afterwards."""
    yield fused.set_mode
    fused.set_mode(None)


def _both(fn: Any) -> tuple[Any, Any]:
    """``fn()`` on the eager path, then on the fused path."""
    fused.set_mode("eager")
    eager = fn()
    fused.set_mode("fused")
    return eager, fn()


def _layer(n: int, tail: int, dtype: torch.dtype, seed: int, loud: float) -> torch.Tensor:
    x = realistic_kv(n * T + tail, H, D, torch.float32, seed=seed)
    x[:, :, 0, 1] *= loud  # a channel far louder (or quieter) than the rest
    x[1, ::3, 1] = 0.0  # zero tokens
    return x.to(dtype)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 7),
    tail=st.integers(0, T - 1),
    seed=st.integers(0, 2**16),
    loud=st.sampled_from([1.0, 1e-6, 30.0, 3e3]),
    kind=st.sampled_from(["xxh3_64", "mulsum64"]),
    strided=st.booleans(),
)
def test_fused_blocks_are_the_eager_bytes(
    n: int, tail: int, seed: int, loud: float, kind: str, strided: bool
) -> None:
    """Odd and even block counts (one graph: N is dynamic), a partial tail, strided
    layers, both checksums: the same chunks, and the same decoded bits."""
    layer = _layer(n, tail, MULTI[0], seed, loud)
    if strided:
        layer = torch.cat([layer, layer], 2)[:, :, :H]  # every token row has a gap
    keys = [ChunkKey(bytes([i]) * 16, 3, 1) for i in range(n)]
    try:
        eager, got = _both(
            lambda: torch.stack(encode_blocks(layer, T, keys, MULTI[1], checksum=kind))
        )
        assert torch.equal(eager, got)
        for row in eager:
            a, b = _both(lambda row=row: decode_chunk(row))
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    finally:
        fused.set_mode(None)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), loud=st.sampled_from([1.0, 1e-6, 3e3]))
def test_fused_chunk_is_the_eager_bytes(seed: int, loud: float) -> None:
    t = _layer(1, 0, SINGLE[0], seed, loud)
    try:
        eager, got = _both(lambda: encode_chunk(t, SINGLE[1], KEY))
        assert torch.equal(eager, got)
        out = torch.full((2, 3 * T, H, D), 7.0, dtype=SINGLE[0])
        a, b = _both(lambda: decode_chunk(eager, out=out[:, T : 2 * T]).clone())
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        assert bool((out[:, :T] == 7).all()) and bool((out[:, 2 * T :] == 7).all())
    finally:
        fused.set_mode(None)


@pytest.mark.parametrize("kind", ["xxh3_64", "mulsum64"])
def test_fused_reproduces_the_pinned_digests(kind: str, mode: Any) -> None:
    """tests/test_codec.py's pinned chunks, through the fused graphs."""
    mode("fused")
    dtype, scheme = SINGLE
    buf = encode_chunk(_pinned_kv(dtype), scheme, KEY, checksum=kind)
    decoded = decode_chunk(buf).contiguous().view(torch.uint8)
    digests = (xxhash.xxh3_64_hexdigest(buf.numpy()), xxhash.xxh3_64_hexdigest(decoded.numpy()))
    assert digests == PINNED[("float16", scheme, kind)]
    dtype, scheme = MULTI  # block 0 of a 2-block layer is the pinned chunk
    layer = torch.cat([_pinned_kv(dtype), _pinned_kv(dtype).flip(1)], 1)
    first = encode_blocks(layer, T, [KEY, KEY], scheme)[0]
    decoded = decode_chunk(first).contiguous().view(torch.uint8)
    digests = (xxhash.xxh3_64_hexdigest(first.numpy()), xxhash.xxh3_64_hexdigest(decoded.numpy()))
    assert digests == PINNED[("bfloat16", scheme, "xxh3_64")]


def test_eager_reference_of_the_fused_math_is_the_codec() -> None:
    """The fused math run eagerly already gives the codec's bytes (so a difference under
    compilation is the compiler's, not the formula's) — on every mode and dtype."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for scheme, modes in codec._SCHEME_MODES.items():
            if scheme in codec._INT4_GROUPS:
                continue  # INT4 has no compiled path (its own test below)
            x = _layer(3, 0, dtype, 5, 30.0).unflatten(1, (3, T))
            qk, qv, *scales = fused.reference_quantize(x[0], x[1], modes)
            name = codec._SCHEME_NAMES[scheme]
            fused.set_mode("eager")
            rows = torch.stack(encode_blocks(x.flatten(1, 2), T, [None] * 3, name))
            fused.set_mode(None)
            layout = codec._layout(T, H, D, dtype, scheme)
            codes = codec._payload_view(rows, layout)
            assert torch.equal(codes[:, 0], qk) and torch.equal(codes[:, 1], qv)
            rows16 = rows.view(torch.float16)
            views = codec._scale_views(rows16, 32, layout)
            for view, s in zip([*views[0], *views[1]], scales, strict=True):
                assert torch.equal(view.view(torch.int16), s.view(torch.int16))


# ----------------------------------------------------------------------------- switch


@pytest.mark.parametrize(
    ("env", "expect"),
    [("eager", "eager"), ("fused", "fused"), ("auto", "auto"), (" FUSED ", "fused"),
     ("", "auto"), (None, "auto")],
)  # fmt: skip
def test_env_switch(env: str | None, expect: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if env is None:
        monkeypatch.delenv(fused.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(fused.ENV_VAR, env)
    fused.set_mode(None)
    try:
        assert fused.get_mode() == expect
        monkeypatch.setenv(fused.ENV_VAR, "eager")
        assert fused.get_mode() == expect  # read once
    finally:
        fused.set_mode(None)


def test_bad_env_value_is_logged_and_auto(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(fused.ENV_VAR, "turbo")
    fused.set_mode(None)
    with caplog.at_level(logging.WARNING, "kvstore.core.fused"):
        assert fused.get_mode() == "auto"
    assert "turbo" in caplog.text
    with pytest.raises(ValueError):
        fused.set_mode("turbo")
    fused.set_mode(None)


def test_eager_and_auto_on_cpu_never_compile(monkeypatch: pytest.MonkeyPatch, mode: Any) -> None:
    monkeypatch.setattr(fused, "_state", fused._State())
    t = _layer(1, 0, torch.float32, 1, 1.0)
    for m in ("eager", "auto"):
        mode(m)
        decode_chunk(encode_chunk(t, "int8-kt-vt"))
    assert not fused.compile_log() and not fused._state.graphs
    assert "cpu" not in fused.AUTO_DEVICES


def test_int4_runs_eager_in_every_mode(monkeypatch: pytest.MonkeyPatch, mode: Any) -> None:
    """INT4 has no compiled kernels: under ``fused`` it compiles nothing and gives the
    eager bytes and values."""
    monkeypatch.setattr(fused, "_state", fused._State())
    t = _layer(2, 0, torch.bfloat16, 3, 30.0)
    mode("eager")
    expect = encode_blocks(t, T, [KEY, KEY], "int4")
    decoded = decode_chunk(expect[1])
    mode("fused")
    got = encode_blocks(t, T, [KEY, KEY], "int4")
    assert all(torch.equal(g, e) for g, e in zip(got, expect, strict=True))
    assert torch.equal(decode_chunk(got[1]), decoded)
    assert not fused.compile_log() and not fused._state.graphs


# ----------------------------------------------------------------------------- fallback


def test_compile_failure_falls_back_once_logged_never_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, mode: Any
) -> None:
    calls = []

    def broken(gm: Any, example_inputs: Any) -> Any:
        calls.append(gm)
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(fused, "_state", fused._State())
    monkeypatch.setattr(fused, "_BACKEND", broken)
    t = _layer(1, 0, torch.float32, 2, 1.0)
    mode("eager")
    expect = encode_chunk(t, "int8-kt-vt", KEY)
    decoded = decode_chunk(expect)
    mode("fused")
    with caplog.at_level(logging.WARNING, "kvstore.core.fused"):
        for _ in range(3):
            got = encode_chunk(t, "int8-kt-vt", KEY)
            assert torch.equal(got, expect)
            assert torch.equal(decode_chunk(got), decoded)
    assert len(calls) == 1  # tried once, then eager for good
    assert caplog.text.count("fused codec failed") == 1 and "no C++ compiler" in caplog.text
    assert [r.ok for r in fused.compile_log()] == [False]
    mode("fused")  # set_mode forgets the failure: the next call tries again
    assert torch.equal(encode_chunk(t, "int8-kt-vt", KEY), expect) and len(calls) == 2

"""Paged-KV adapters: chunk mapping, bit-exact round trips against the contiguous path,
copy accounting, untouched neighbours and every validation error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvclient.paged import (
    ChunkView,
    PagedCache,
    Piece,
    chunk_views,
    decode_into,
    encode_paged,
    gather_chunk,
    paged_copy_stats,
    scatter_chunk,
)
from kvstore.core.codec import ChunkKey, decode_chunk, encode_chunk
from kvstore.errors import BadShape, ChecksumError, ChunkKeyMismatch, InvalidArgument

B = 256  # our block_tokens
H, D = 2, 8
SENTINEL = -7.25
LAYOUTS = ["blocks_first", "kv_first"]


# ----------------------------------------------------------------------------- reference
# Written token by engine block, independently of the module under test.


def new_cache(
    layout: str, num_blocks: int, bs: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    shape = (num_blocks, 2, bs, H, D) if layout == "blocks_first" else (2, num_blocks, bs, H, D)
    return torch.full(shape, SENTINEL, dtype=dtype)


def kv_of(cache: torch.Tensor, layout: str) -> torch.Tensor:
    return cache.transpose(0, 1) if layout == "blocks_first" else cache


def spans(ids: list[int], bs: int, n_tokens: int) -> list[tuple[int, int, int]]:
    """(engine block, first token of the request in it, tokens) for tokens 0..n_tokens-1."""
    return [(b, i * bs, min(bs, n_tokens - i * bs)) for i, b in enumerate(ids) if i * bs < n_tokens]


def write_ref(cache: torch.Tensor, layout: str, ids: list[int], layer: torch.Tensor) -> None:
    kv = kv_of(cache, layout)
    for b, t0, n in spans(ids, kv.shape[2], layer.shape[1]):
        kv[:, b, :n] = layer[:, t0 : t0 + n]


def read_ref(cache: torch.Tensor, layout: str, ids: list[int], n_tokens: int) -> torch.Tensor:
    kv = kv_of(cache, layout)
    return torch.cat([kv[:, b, :n] for b, _, n in spans(ids, kv.shape[2], n_tokens)], dim=1)


def untouched(cache: torch.Tensor, layout: str, ids: list[int], n_tokens: int) -> bool:
    """Whether every cache position outside the request's first n_tokens is the sentinel."""
    kv = kv_of(cache, layout)
    mask = torch.ones(kv.shape[1], kv.shape[2], dtype=torch.bool)
    for b, _, n in spans(ids, kv.shape[2], n_tokens):
        mask[b, :n] = False
    return bool((kv[:, mask] == SENTINEL).all())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def keys(n: int, layer: int = 3) -> list[ChunkKey]:
    return [ChunkKey(bytes([j + 1] * 16), layer, 0) for j in range(n)]


def setup_layer(
    layout: str, bs: int, n_chunks: int, seed: int = 0, tail: int = 40
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A random layer of n_chunks*B + tail tokens, written into shuffled engine blocks."""
    gen = torch.Generator().manual_seed(seed)
    n_tokens = n_chunks * B + tail
    needed = -(-n_tokens // bs)
    layer = torch.randn(2, n_tokens, H, D, generator=gen).to(torch.bfloat16)
    ids = np.random.default_rng(seed).permutation(2 * needed + 3)[:needed].tolist()
    cache = new_cache(layout, 2 * needed + 3, bs)
    write_ref(cache, layout, ids, layer)
    return layer, cache, ids


def stats_delta(before: object) -> dict[str, int]:
    after = paged_copy_stats()
    return {k: getattr(after, k) - getattr(before, k) for k in vars(after)}


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("quant", ["int8", "none"])
@pytest.mark.parametrize("bs", [16, 256, 512, 96, 384, 1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_bit_identical_to_contiguous_path(layout: str, bs: int, quant: str) -> None:
    n = 3
    layer, cache, ids = setup_layer(layout, bs, n)
    ks = keys(n)
    ref = [encode_chunk(layer[:, j * B : (j + 1) * B], quant, ks[j]) for j in range(n)]

    views = chunk_views(cache, ids, B, n, layout, num_kv_heads=H, head_dim=D, dtype="bf16")
    bufs = encode_paged(views, ks, quant)
    assert [bytes(b.numpy()) for b in bufs] == [bytes(r.numpy()) for r in ref]
    for j, v in enumerate(views):  # the per-chunk primitives agree too
        direct = v.tensor
        src = torch.stack(direct) if direct is not None else gather_chunk(v)
        assert torch.equal(bits(src), bits(layer[:, j * B : (j + 1) * B]))

    fresh = new_cache(layout, cache.shape[0 if layout == "blocks_first" else 1], bs)
    wviews = chunk_views(fresh, torch.tensor(ids), B, n, layout, writable=True)
    for j in range(n):
        decode_into(bufs[j], wviews[j], expect_key=ks[j])
    want = torch.cat([decode_chunk(r) for r in ref], dim=1)
    assert torch.equal(bits(read_ref(fresh, layout, ids, n * B)), bits(want))
    assert untouched(fresh, layout, ids, n * B)  # the tail and other blocks kept the sentinel


@pytest.mark.parametrize("bs", [16, 256, 96, 1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_with_skip_leaves_the_engines_own_prefix(layout: str, bs: int) -> None:
    """An engine's local prefix hit ends inside one of our chunks: decoding that chunk with
    ``skip`` writes only its tokens past the hit, whatever the engine block size."""
    n, ks = 2, keys(2)
    layer, cache, ids = setup_layer(layout, bs, n, seed=5)
    bufs = [encode_chunk(layer[:, j * B : (j + 1) * B], "none", ks[j]) for j in range(n)]
    fresh = new_cache(layout, cache.shape[0 if layout == "blocks_first" else 1], bs)
    views = chunk_views(fresh, ids, B, n, layout, writable=True)
    skip = 48 if bs != 96 else 96 + 48
    decode_into(bufs[1], views[1], expect_key=ks[1], skip=skip)
    got = read_ref(fresh, layout, ids, n * B)
    assert torch.equal(bits(got[:, B + skip :]), bits(layer[:, B + skip : n * B]))
    assert bool((got[:, : B + skip] == SENTINEL).all())
    assert untouched(fresh, layout, ids, n * B)  # nothing outside the request either
    for bad in (-1, B, 1.5):
        with pytest.raises(InvalidArgument, match="skip"):
            decode_into(bufs[1], views[1], skip=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_engine_cache_head_major(layout: str) -> None:
    """A cache stored head-major ([.., H, block_size, D] in memory) works through views."""
    bs, n = 16, 2
    layer, dense, ids = setup_layer(layout, bs, n)
    perm = (0, 1, 3, 2, 4)
    cache = dense.permute(perm).contiguous().permute(perm)  # same values, other strides
    assert not cache.is_contiguous()
    ks = keys(n)
    bufs = encode_paged(chunk_views(cache, ids, B, n, layout), ks)
    ref = [encode_chunk(layer[:, j * B : (j + 1) * B], key=ks[j]) for j in range(n)]
    assert [bytes(b.numpy()) for b in bufs] == [bytes(r.numpy()) for r in ref]
    fresh = torch.full_like(cache, SENTINEL)
    for j, v in enumerate(chunk_views(fresh, ids, B, n, layout, writable=True)):
        decode_into(bufs[j], v)
    want = torch.cat([decode_chunk(r) for r in ref], dim=1)
    assert torch.equal(bits(read_ref(fresh, layout, ids, n * B)), bits(want))
    assert untouched(fresh, layout, ids, n * B)


# ----------------------------------------------------------------------------- mapping and copies


def test_pieces_of_unaligned_engine_blocks() -> None:
    cache = new_cache("kv_first", 20, 96)
    ids = [9, 3, 11, 0, 5, 7]
    v0, v1 = chunk_views(cache, ids, B, 2, "kv_first")
    assert v0.pieces == (Piece(9, 0, 96), Piece(3, 0, 96), Piece(11, 0, 64))
    assert v1.pieces == (Piece(11, 64, 32), Piece(0, 0, 96), Piece(5, 0, 96), Piece(7, 0, 32))
    assert v0.blocks is None and not v0.direct and v1.tensor is None
    assert [k.shape[0] for k, _ in v1.piece_tensors()] == [32, 96, 96, 32]


def test_engine_blocks_larger_than_ours_are_direct() -> None:
    cache = new_cache("blocks_first", 4, 512)
    views = chunk_views(cache, [2, 0], B, 3, "blocks_first")
    assert [v.pieces for v in views] == [(Piece(2, 0, B),), (Piece(2, B, B),), (Piece(0, 0, B),)]
    t = views[1].tensor
    assert t is not None and t[0].data_ptr() == cache[2, 0, B].data_ptr()  # a view, not a copy
    assert t[1].data_ptr() == cache[2, 1, B].data_ptr()


def test_consecutive_blocks_merge_where_adjacent_in_memory() -> None:
    ids = [*range(5, 5 + 3 * B // 16), 1]
    merged = chunk_views(new_cache("kv_first", 64, 16), ids, B, 3, "kv_first")
    assert all(v.direct for v in merged)
    assert merged[1].pieces == (Piece(5 + 16, 0, B),)
    split = chunk_views(new_cache("blocks_first", 64, 16), ids, B, 3, "blocks_first")
    assert not any(v.direct for v in split)  # K and V interleave per block: no single view


@pytest.mark.parametrize(
    ("layout", "bs", "consecutive", "direct"),
    [
        ("blocks_first", 16, False, False),
        ("kv_first", 16, False, False),
        ("kv_first", 16, True, True),
        ("blocks_first", 256, False, True),
        ("kv_first", 512, False, True),
    ],
)
def test_copy_accounting(layout: str, bs: int, consecutive: bool, direct: bool) -> None:
    n = 4
    layer, cache, ids = setup_layer(layout, bs, n, tail=0)
    if consecutive:
        ids = list(range(len(ids)))
        write_ref(cache, layout, ids, layer)
    views = chunk_views(cache, ids, B, n, layout)
    chunk = 2 * B * H * D * 2
    before = paged_copy_stats()
    bufs = encode_paged(views, keys(n))
    got = stats_delta(before)
    assert got["gathered_bytes"] == (0 if direct else n * chunk)
    assert (got["direct_chunks"], got["staged_chunks"]) == ((n, 0) if direct else (0, n))

    wviews = chunk_views(torch.full_like(cache, SENTINEL), ids, B, n, layout, writable=True)
    before = paged_copy_stats()
    for buf, v in zip(bufs, wviews, strict=True):
        decode_into(buf, v)
    assert stats_delta(before)["scattered_bytes"] == (0 if direct else n * chunk)


def test_encode_with_small_staging_buffer_and_decode_with_staging() -> None:
    n = 5
    layer, cache, ids = setup_layer("blocks_first", 16, n)
    ks = keys(n)
    staging = torch.empty(2, 2 * B, H, D, dtype=torch.bfloat16)  # two chunks per pass
    bufs = encode_paged(chunk_views(cache, ids, B, n), ks, staging=staging)
    ref = [encode_chunk(layer[:, j * B : (j + 1) * B], key=ks[j]) for j in range(n)]
    assert [bytes(b.numpy()) for b in bufs] == [bytes(r.numpy()) for r in ref]
    out = torch.empty(n, ref[0].numel(), dtype=torch.uint8)
    rows = encode_paged(chunk_views(cache, ids, B, n), ks, out=out)
    assert rows[2].data_ptr() == out[2].data_ptr()
    fresh = torch.full_like(cache, SENTINEL)
    for j, v in enumerate(chunk_views(fresh, ids, B, n, writable=True)):
        decode_into(bufs[j], v, staging=staging)
    assert torch.equal(bits(read_ref(fresh, "blocks_first", ids, n * B)), bits(
        torch.cat([decode_chunk(r) for r in ref], dim=1)
    ))  # fmt: skip


def test_gather_and_scatter_chunk() -> None:
    layer, cache, ids = setup_layer("kv_first", 96, 2)
    views = chunk_views(cache, ids, B, 2, "kv_first")
    out = torch.empty(2, B, H, D, dtype=torch.bfloat16)
    assert gather_chunk(views[1], out) is out
    assert torch.equal(bits(out), bits(layer[:, B : 2 * B]))
    fresh = torch.full_like(cache, SENTINEL)
    wview = chunk_views(fresh, ids, B, 2, "kv_first", writable=True)[1]
    scatter_chunk(out, wview)
    assert torch.equal(bits(read_ref(fresh, "kv_first", ids, 2 * B)[:, B:]), bits(out))
    assert bool((read_ref(fresh, "kv_first", ids, B) == SENTINEL).all())  # chunk 0 untouched


@pytest.mark.parametrize(
    "make_ids",
    [
        list,
        tuple,
        lambda x: np.array(x, dtype=np.int32),
        lambda x: np.array(x, dtype=np.uint16),
        lambda x: [np.int64(i) for i in x],
        lambda x: torch.tensor(x, dtype=torch.int32),
        lambda x: torch.tensor(x, dtype=torch.int64),
    ],
)
def test_block_id_containers(make_ids: object) -> None:
    cache = new_cache("kv_first", 40, 16)
    ids = [7, 3, 30, 1, 12, 9, 11, 13, 17, 19, 21, 23, 25, 27, 29, 31, 0]
    got = chunk_views(cache, make_ids(ids), B, 1, "kv_first")  # type: ignore[operator]
    assert got[0].pieces == tuple(Piece(i, 0, 16) for i in ids[:16])
    assert got[0].blocks is not None and got[0].blocks.tolist() == ids[:16]


def test_block_ids_are_snapshotted() -> None:
    layer, cache, ids = setup_layer("kv_first", 16, 1)
    table = torch.tensor(ids, dtype=torch.int64)
    views = chunk_views(cache, table, B, 1, "kv_first")
    table.fill_(0)  # the engine reuses its block table row
    assert torch.equal(bits(gather_chunk(views[0])), bits(layer[:, :B]))


def test_repeated_block_ids_read_but_never_written() -> None:
    cache = new_cache("blocks_first", 8, 128)
    kv_of(cache, "blocks_first")[:, 4] = 1.5
    views = chunk_views(cache, [4, 4, 4, 4], B, 2)
    buf = encode_paged(views, [None, None], "none")[1]
    assert bool((decode_chunk(buf) == 1.5).all())
    with pytest.raises(InvalidArgument, match="block id 4 appears at positions"):
        chunk_views(cache, [4, 4, 4, 4], B, 2, writable=True)


def test_ids_past_the_needed_ones_are_not_checked() -> None:
    cache = new_cache("blocks_first", 8, 256)
    views = chunk_views(cache, [3, -1, 99, 3], B, 1, writable=True)  # a padded table row
    assert views[0].pieces == (Piece(3, 0, B),)
    assert chunk_views(cache, [], B, 0) == []
    assert encode_paged([], []) == []


# ----------------------------------------------------------------------------- refusals


def test_bad_chunks_leave_the_cache_untouched() -> None:
    for bs in (16, 256):  # staged and direct
        layer, cache, ids = setup_layer("blocks_first", bs, 1, tail=0)
        buf = encode_chunk(layer[:, :B], key=keys(1)[0])
        fresh = torch.full_like(cache, SENTINEL)
        view = chunk_views(fresh, ids, B, 1, writable=True)[0]
        flipped = buf.clone()
        flipped[200] ^= 1
        with pytest.raises(ChecksumError):
            decode_into(flipped, view)
        with pytest.raises(ChunkKeyMismatch):
            decode_into(buf, view, expect_key=keys(2)[1])
        with pytest.raises(BadShape):
            decode_into(encode_chunk(layer[:, : B // 2]), view)
        assert bool((fresh == SENTINEL).all())


def _cache() -> torch.Tensor:
    return new_cache("blocks_first", 8, 16)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: chunk_views([1.0], [0], B, 1), InvalidArgument, "must be a Tensor"),  # type: ignore[arg-type]
        (lambda: chunk_views(torch.zeros(8, 2, 16, 4), [0], B, 0), BadShape, "must be"),
        (lambda: chunk_views(torch.zeros(8, 3, 16, H, D), [0], B, 0), BadShape, "blocks_first"),
        (
            lambda: chunk_views(torch.zeros(3, 8, 16, H, D), [0], B, 0, "kv_first"),
            BadShape,
            r"\[2, num_blocks",
        ),
        (lambda: chunk_views(_cache(), [0], B, 0, "nhd"), InvalidArgument, "unknown layout"),
        (
            lambda: chunk_views(torch.zeros(8, 2, 16, H, D, dtype=torch.int8), [0], B, 0),
            BadShape,
            "dtype",
        ),
        (lambda: chunk_views(_cache(), [0], B, 0, num_kv_heads=4), BadShape, "num_kv_heads=2"),
        (lambda: chunk_views(_cache(), [0], B, 0, head_dim=64), BadShape, "head_dim=8"),
        (lambda: chunk_views(_cache(), [0], B, 0, dtype=torch.float16), BadShape, "expected"),
        (lambda: chunk_views(_cache(), range(16), B, 1), InvalidArgument, r"block_ids\[8\] = 8"),
        (lambda: chunk_views(_cache(), [0, -2], 32, 1), InvalidArgument, r"\[1\] = -2"),
        (lambda: chunk_views(_cache(), [0, 1], 48, 1), InvalidArgument, "need 3 engine blocks"),
        (lambda: chunk_views(_cache(), [1, 1], 32, 1, writable=True), InvalidArgument, "twice"),
        (lambda: chunk_views(_cache(), torch.tensor([0.0]), 16, 1), InvalidArgument, "float"),
        (lambda: chunk_views(_cache(), torch.tensor([True]), 16, 1), InvalidArgument, "bool"),
        (lambda: chunk_views(_cache(), [0, 1.0], 32, 1), InvalidArgument, "ints"),
        (lambda: chunk_views(_cache(), [True], 16, 1), InvalidArgument, "ints"),
        (lambda: chunk_views(_cache(), np.array([0.5]), 16, 1), InvalidArgument, "float"),
        (lambda: chunk_views(_cache(), np.zeros((2, 2), int), 16, 1), InvalidArgument, "1-D"),
        (lambda: chunk_views(_cache(), "0123", 16, 1), InvalidArgument, "got str"),
        (lambda: chunk_views(_cache(), [2**70], 16, 1), InvalidArgument, "int64"),
        (lambda: chunk_views(_cache(), [0], 0, 1), InvalidArgument, "block_tokens"),
        (lambda: chunk_views(_cache(), [0], 16, -1), InvalidArgument, "n_chunks"),
        (
            lambda: chunk_views(PagedCache(_cache()), [0], 16, 1, "kv_first"),
            InvalidArgument,
            "layout='kv_first' but",
        ),
        (lambda: PagedCache(_cache()).span(Piece(8, 0, 4)), InvalidArgument, "outside"),
        (lambda: PagedCache(_cache()).span(Piece(0, 8, 16)), InvalidArgument, "crosses"),
    ],
)
def test_validation_errors(call: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()  # type: ignore[operator]


def test_copy_and_encode_argument_errors() -> None:
    cache = _cache()
    views = chunk_views(cache, list(range(8)), 32, 2)
    other = chunk_views(cache, list(range(8)), 32, 2)
    with pytest.raises(BadShape):
        gather_chunk(views[0], torch.empty(2, 16, H, D, dtype=torch.bfloat16))
    with pytest.raises(InvalidArgument, match="contiguous"):
        gather_chunk(views[0], torch.empty(2, H, 32, D, dtype=torch.bfloat16).transpose(1, 2))
    with pytest.raises(BadShape):
        scatter_chunk(torch.empty(2, 32, H, D), views[0])  # float32 into bfloat16
    chunk = torch.zeros(2, 32, H, D, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgument, match="writable=True"):
        scatter_chunk(chunk, views[0])
    with pytest.raises(InvalidArgument, match="writable=True"):
        decode_into(encode_chunk(chunk), views[0])
    assert bool((cache == SENTINEL).all())
    with pytest.raises(InvalidArgument, match="2 keys for 1"):
        encode_paged(views[:1], [None, None])
    with pytest.raises(InvalidArgument, match="one chunk_views"):
        encode_paged([views[0], other[1]], [None, None])
    with pytest.raises(InvalidArgument, match="ChunkViews"):
        encode_paged(["x"], [None])  # type: ignore[list-item]
    with pytest.raises(BadShape, match="staging"):
        encode_paged(views, [None, None], staging=torch.empty(2, 48, H, D, dtype=torch.bfloat16))
    with pytest.raises(InvalidArgument, match="out must be"):
        encode_paged(views, [None, None], out=torch.empty(1, 8, dtype=torch.uint8))
    assert isinstance(views[0], ChunkView) and views[0].nbytes == 2 * 32 * H * D * 2


# ----------------------------------------------------------------------------- property


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(LAYOUTS),
    bs=st.integers(1, 48),
    block_tokens=st.integers(1, 40),
    n=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    run=st.booleans(),
)
def test_any_geometry_round_trips_raw(
    layout: str, bs: int, block_tokens: int, n: int, seed: int, run: bool
) -> None:
    rng = np.random.default_rng(seed)
    needed = -(-n * block_tokens // bs)
    nb = needed + int(rng.integers(0, 4))
    ids = (np.arange(needed) + nb - needed) if run else rng.permutation(nb)[:needed]
    ids = ids.tolist()
    layer = torch.from_numpy(rng.standard_normal((2, n * block_tokens, 1, 4), np.float32))
    cache = torch.full(
        (nb, 2, bs, 1, 4) if layout == "blocks_first" else (2, nb, bs, 1, 4), SENTINEL
    )
    write_ref(cache, layout, ids, layer)
    views = chunk_views(cache, ids, block_tokens, n, layout)
    bufs = encode_paged(views, [None] * n, "none")
    fresh = torch.full_like(cache, SENTINEL)
    for buf, v in zip(bufs, chunk_views(fresh, ids, block_tokens, n, layout, writable=True),
                      strict=True):  # fmt: skip
        decode_into(buf, v)
    assert torch.equal(read_ref(fresh, layout, ids, n * block_tokens), layer)
    assert untouched(fresh, layout, ids, n * block_tokens)

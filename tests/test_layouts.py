"""Engine page forms onto canonical K and V (``kvclient.layouts``, the vLLM adapter's
``page_form``): every form read and written per token against the engine's own indexing
(``tests/pageforms.py``), certification by a probe through the engine's write, chunks that
move between forms and block sizes unchanged, and clear refusals. vLLM's own kernels are
checked the same way in ``tests/test_vllm.py`` (its environment of its own)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvclient.layouts import (
    PROBE_BASE,
    PROBE_DIGITS,
    LayoutError,
    certify,
    halves,
    probe_index,
    probe_kv,
    scratch_like,
)
from kvclient.paged import PagedCache, Piece, chunk_views, decode_into, encode_paged
from kvclient.vllm_connector import page_form
from kvstore.core.codec import ChunkKey, decode_chunk
from tests import pageforms

H, D = 2, 32
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def form_of(form: str) -> str:
    return "bhnc" if form.startswith("bhnc") else form


def known_kv(tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """[2, T, H, D] with every value distinct enough to catch a misplaced element."""
    x = torch.randn(2, tokens, H, D, generator=torch.Generator().manual_seed(tokens))
    return (x * 4).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", pageforms.FORMS)
def test_halves_read_and_write_what_the_engine_indexes(form: str, dtype: torch.dtype) -> None:
    N, blocks = 32, 5
    cache = pageforms.new(form, blocks, N, H, D, dtype)
    kv = known_kv(blocks * N, dtype)
    for s in range(blocks * N):
        pageforms.write(form, cache, s, kv[0, s], kv[1, s])
    k, v = halves(cache, form_of(form), D)
    storage = cache.untyped_storage().data_ptr()  # views of the cache, not copies
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() == storage
    assert torch.equal(k.reshape(-1, H, D), kv[0]) and torch.equal(v.reshape(-1, H, D), kv[1])
    paged = PagedCache((k, v), "kv_pair")
    assert (paged.num_blocks, paged.block_size, paged.num_kv_heads, paged.head_dim) == (
        blocks, N, H, D)  # fmt: skip
    assert paged.tiled == (form == "cpu_amx")
    # in place only where channels are adjacent: CPU pages' K is transposed, AMX tiled
    assert paged.in_place == (form not in ("cpu_dn", "cpu_amx"))
    (view,) = chunk_views(paged, [0], N, 1)
    assert view.direct == paged.in_place
    # and the other way round: written through the views, read by the engine's indexing
    other = pageforms.new(form, blocks, N, H, D, dtype)
    written = PagedCache(halves(other, form_of(form), D), "kv_pair")
    for b in range(blocks):
        written.write(Piece(b, 0, N), kv[0, b * N : (b + 1) * N], kv[1, b * N : (b + 1) * N])
    for s in (0, 1, N - 1, N, 3 * N + 7, blocks * N - 1):
        got_k, got_v = pageforms.read(form, other, s)
        assert torch.equal(got_k, kv[0, s]) and torch.equal(got_v, kv[1, s])


@pytest.mark.parametrize("form", pageforms.FORMS)
def test_certify_accepts_the_engines_form_and_refuses_a_wrong_one(form: str) -> None:
    cache = pageforms.new(form, 3, 32, H, D, torch.bfloat16)
    certify(cache, form_of(form), D, pageforms.writer(form), "test")
    if cache.dim() == 4:  # the bug this catches: CPU pages read as [B, H, N, 2D] K|V
        wrong = "bhnc" if form.startswith("cpu") else "cpu_dn"
        with pytest.raises(LayoutError, match=r"does not read them|contiguous"):
            certify(cache, wrong, D, pageforms.writer(form), "test")


def test_scratch_keeps_the_stride_order() -> None:
    cache = pageforms.new("bhnc_nhd", 7, 32, H, D, torch.float32)
    s = scratch_like(cache, "bhnc")
    assert s.shape == (2, H, 32, 2 * D)
    order = lambda t: sorted(range(4), key=lambda i: -t.stride(i))  # noqa: E731
    assert order(s) == order(cache)


def test_probe_digits_are_exact_and_name_every_element() -> None:
    for dtype in DTYPES:
        passes = [probe_kv(64, 8, 128, dtype, torch.device("cpu"), p) for p in range(PROBE_DIGITS)]
        for k, v in passes:
            assert torch.equal(k.float().round(), k.float()) and int(k.max()) < PROBE_BASE
            assert torch.equal(v.float().round(), v.float()) and int(v.min()) >= 0
        index = probe_index([torch.stack(kv) for kv in passes])
        assert torch.equal(index.flatten(), torch.arange(2 * 64 * 8 * 128))


def test_certify_sees_one_element_out_of_place() -> None:
    """A form that swaps two tokens 61 apart (or any two elements) is refused: the probe
    names each element, not a pattern with a period."""
    form = "bhnc_hnd"

    def swapping(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                 slots: torch.Tensor) -> None:  # fmt: skip
        order = slots.clone()
        order[[0, 61]] = order[[61, 0]]
        pageforms.writer(form)(key, value, cache, order)

    cache = pageforms.new(form, 3, 64, H, D, torch.bfloat16)
    with pytest.raises(LayoutError, match=r"256 of .* out of place"):
        certify(cache, "bhnc", D, swapping, "test")


@pytest.mark.parametrize("quant", ["none", "int8"])
@pytest.mark.parametrize(("src", "src_bs", "dst", "dst_bs"), [
    ("cpu_dn", 32, "bhnc_nhd", 64),
    ("bhnc_hnd", 64, "cpu_dn", 32),
    ("kv_first", 16, "cpu_dn", 96),
    ("cpu_dn", 128, "blocks_first", 32),
    ("cpu_amx", 32, "cpu_dn", 64),
    ("bhnc_nhd", 64, "cpu_amx", 32),
    ("kv_first", 16, "cpu_amx", 96),  # chunks of 64 in blocks of 96: partial tiled blocks
    ("cpu_amx", 96, "bhnc_hnd", 32),
])  # fmt: skip
def test_chunks_move_between_forms_and_block_sizes(
    src: str, src_bs: int, dst: str, dst_bs: int, quant: str
) -> None:
    """A chunk encoded from one engine's pages is the canonical KV: decoded into another
    form and block size it gives each token's K and V (what an engine with another
    --block-size or backend reads)."""
    B, n_chunks, T = 64, 3, 192
    kv = known_kv(T, torch.float32)
    scache = pageforms.new(src, T // src_bs + 2, src_bs, H, D, torch.float32)
    sids = list(range(T // src_bs + 1, 0, -1))  # blocks out of order
    for t in range(T):
        slot = sids[t // src_bs] * src_bs + t % src_bs
        pageforms.write(src, scache, slot, kv[0, t], kv[1, t])
    paged = PagedCache(halves(scache, form_of(src), D), "kv_pair")
    keys = [ChunkKey(bytes([j + 1] * 16), 0, 0) for j in range(n_chunks)]
    bufs = encode_paged(chunk_views(paged, sids, B, n_chunks), keys, quant)
    for j, buf in enumerate(bufs):  # each chunk holds canonical [2, B, H, D]
        want = kv[:, j * B : (j + 1) * B]
        got = decode_chunk(buf)
        assert torch.allclose(got, want, atol=0 if quant == "none" else 0.1), (j, quant)

    dcache = pageforms.new(dst, T // dst_bs + 3, dst_bs, H, D, torch.float32, fill=-7.0)
    dids = [T // dst_bs + 2 - i for i in range(T // dst_bs)]
    dpaged = PagedCache(halves(dcache, form_of(dst), D), "kv_pair")
    for j, view in enumerate(chunk_views(dpaged, dids, B, n_chunks, writable=True)):
        decode_into(bufs[j], view, expect_key=keys[j])
    for t in range(T):
        k, v = pageforms.read(dst, dcache, dids[t // dst_bs] * dst_bs + t % dst_bs)
        tol = 0 if quant == "none" else 0.1
        assert torch.allclose(k, kv[0, t], atol=tol) and torch.allclose(v, kv[1, t], atol=tol)


def layer(backend: str, isa: str | None = None) -> SimpleNamespace:
    named = SimpleNamespace(get_name=lambda: backend)
    return SimpleNamespace(attn_backend=named, isa=isa)


def test_page_form_from_backend_isa_and_shape() -> None:
    cpu = pageforms.new("cpu_dn", 4, 32, H, D, torch.bfloat16)
    assert page_form(cpu, layer("CPU_ATTN", "vec"), D, "l0")[0] == "cpu_dn"
    assert page_form(cpu, layer("CPU_ATTN", "vec16"), D, "l0")[0] == "cpu_dn"
    assert page_form(cpu, layer("CPU_ATTN", "amx"), D, "l0")[0] == "cpu_amx"
    assert page_form(cpu, layer("FLASH_ATTN"), D, "l0")[0] == "bhnc"
    assert page_form(cpu, layer("TRITON_ATTN"), D, "l0")[0] == "bhnc"
    fa = pageforms.new("kv_first", 4, 32, H, D, torch.bfloat16)
    assert page_form(fa, None, D, "l0")[0] == "kv_first"
    fi = pageforms.new("blocks_first", 4, 32, H, D, torch.bfloat16)
    assert page_form(fi, None, D, "l0")[0] == "blocks_first"


@pytest.mark.parametrize(("cache", "lay", "match"), [
    (torch.zeros(4, H, 32, 2 * D, dtype=torch.bfloat16), layer("CPU_ATTN", "neon"), "neon"),
    (torch.zeros(4, H, 32, 2 * D), None, "backend unknown.*not a page form"),
    (torch.zeros(4, H, 32, 2 * D), layer("SOME_NEW_ATTN"), "SOME_NEW_ATTN"),
    (torch.zeros(4, H, 32, 2 * D, dtype=torch.uint8), layer("FLASH_ATTN"), "float16"),
    (torch.zeros(4, 32, 1, 576), layer("FLASHMLA"), "FLASHMLA"),
    (torch.zeros(2, 2, 32, H, D), None, "either"),
])  # fmt: skip
def test_page_form_refuses_what_it_cannot_map(
    cache: torch.Tensor, lay: SimpleNamespace | None, match: str
) -> None:
    with pytest.raises(LayoutError, match=match):
        page_form(cache, lay, D, "model.layers.0.self_attn.attn")

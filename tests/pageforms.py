"""Engine page forms written and read token by token with each engine's own indexing, as
its kernels do (independent of ``kvclient.layouts``, which the tests check against them).

``new(form, blocks, N, H, D)`` allocates a cache as the engine does; ``write(form, cache,
slot, k, v)`` stores one token's ``[H, D]`` K and V at slot ``slot`` (block ``slot // N``,
offset ``slot % N``); ``read(form, cache, slot)`` gives them back.
"""

from __future__ import annotations

import torch

FORMS = ("kv_first", "blocks_first", "bhnc_nhd", "bhnc_hnd", "cpu_dn", "cpu_amx")
BACKEND = {  # what vLLM backend allocates each (the backend name a layer reports)
    "kv_first": "FLASH_ATTN",
    "blocks_first": "FLASHINFER",
    "bhnc_nhd": "FLASH_ATTN",
    "bhnc_hnd": "FLASHINFER",
    "cpu_dn": "CPU_ATTN",
    "cpu_amx": "CPU_ATTN",
}
ISA = {"cpu_dn": "vec", "cpu_amx": "amx"}  # the CPU backend's kernels that write each


def new(form: str, blocks: int, N: int, H: int, D: int, dtype: torch.dtype, fill: float = 0.0
        ) -> torch.Tensor:  # fmt: skip
    if form == "kv_first":  # vLLM < 0.32 FlashAttention
        return torch.full((2, blocks, N, H, D), fill, dtype=dtype)
    if form == "blocks_first":  # vLLM < 0.32 FlashInfer
        return torch.full((blocks, 2, N, H, D), fill, dtype=dtype)
    if form == "bhnc_nhd":  # vLLM 0.32 [B, H, N, C] over a block-major NHD (LBNHC) buffer
        return torch.full((blocks, N, H, 2 * D), fill, dtype=dtype).permute(0, 2, 1, 3)
    # bhnc_hnd (LBHNC) and the CPU backend: [B, H, N, 2D] contiguous
    return torch.full((blocks, H, N, 2 * D), fill, dtype=dtype)


def _cpu_halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # cpu_attn.py: kv_cache.view(B, H, 2N, D).chunk(2, dim=2); the vec kernels store each
    # head's K transposed ([D, N]) in the first half and V as [N, D] in the second.
    B, H, N, C = cache.shape
    kc, vc = cache.view(B, H, 2 * N, C // 2).chunk(2, dim=2)
    return kc.reshape(B, H, C // 2, N), vc


def _amx_offsets(N: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, D] element offsets of token t, channel d inside one head's K half and V half of
    an AMX page (the amx kernels' tiles: K in 16-token tiles of channel pairs, V in
    16-channel tiles of token pairs)."""
    t = torch.arange(N).view(N, 1)
    d = torch.arange(D).view(1, D)
    k = (t // 16) * 16 * D + (d // 2) * 32 + (t % 16) * 2 + d % 2
    v = N * D + (d // 16) * 16 * N + (t // 2) * 32 + (d % 16) * 2 + t % 2
    return k, v


def write(form: str, cache: torch.Tensor, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    if form == "cpu_amx":
        B, H, N, C = cache.shape
        ko, vo = _amx_offsets(N, C // 2)
        page = cache.view(B, H, N * C)[slot // N]  # [H, 2*N*D] of the block
        page[:, ko[slot % N]] = k
        page[:, vo[slot % N]] = v
        return
    if form == "cpu_dn":
        N = cache.shape[2]
        kc, vc = _cpu_halves(cache)
        kc[slot // N, :, :, slot % N] = k
        vc[slot // N, :, slot % N] = v
        return
    read(form, cache, slot)  # bounds
    b, n = divmod(slot, _block_size(form, cache))
    if form == "kv_first":
        cache[0, b, n], cache[1, b, n] = k, v
    elif form == "blocks_first":
        cache[b, 0, n], cache[b, 1, n] = k, v
    else:
        D = k.shape[-1]
        cache[b, :, n, :D], cache[b, :, n, D:] = k, v


def read(form: str, cache: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, n = divmod(slot, _block_size(form, cache))
    if form == "kv_first":
        return cache[0, b, n], cache[1, b, n]
    if form == "blocks_first":
        return cache[b, 0, n], cache[b, 1, n]
    if form == "cpu_dn":
        kc, vc = _cpu_halves(cache)
        return kc[b, :, :, n], vc[b, :, n]
    if form == "cpu_amx":
        B, H, N, C = cache.shape
        ko, vo = _amx_offsets(N, C // 2)
        page = cache.view(B, H, N * C)[b]
        return page[:, ko[n]], page[:, vo[n]]
    D = cache.shape[-1] // 2
    return cache[b, :, n, :D], cache[b, :, n, D:]


def _block_size(form: str, cache: torch.Tensor) -> int:
    return int(cache.shape[2])


def writer(form: str):  # type: ignore[no-untyped-def]
    """The engine's cache write in the shape of ``kvclient.layouts.Writer``."""

    def write_all(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                  slots: torch.Tensor) -> None:  # fmt: skip
        for i, s in enumerate(slots.tolist()):
            write(form, cache, s, key[i], value[i])

    return write_all

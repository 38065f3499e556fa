"""vLLM's own CPU cache writes against kvstore's page forms (run under ``.venv-vllm`` by
``tests/test_vllm.py``): for each ISA its CPU backend chooses from and each KV dtype, K and
V written through ``CPUAttentionBackendImpl.do_kv_cache_update`` (vLLM's code, not a
reading of it) must read back through ``kvclient.layouts`` per token, certification must
pass for what ``page_form`` picks and fail for the form the old connector assumed. The
``amx`` ISA (bfloat16 on CPUs with AMX; its cache write runs on any x86 CPU) is checked
the same way. Prints one JSON line of what it checked."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from kvclient.layouts import LayoutError, certify, halves
from kvclient.vllm_connector import page_form, writer_of


def layer(isa: str) -> SimpleNamespace:
    impl = SimpleNamespace(attn_type=AttentionType.DECODER, kv_cache_dtype="auto")
    lay = SimpleNamespace(attn_backend=CPUAttentionBackend, isa=isa, _k_scale_float=1.0,
                          _v_scale_float=1.0)  # fmt: skip
    lay.impl = SimpleNamespace(
        do_kv_cache_update=lambda lay_, k, v, cache, slots: (
            CPUAttentionBackendImpl.do_kv_cache_update(impl, lay_, k, v, cache, slots)
        )
    )
    return lay


def check(isa: str, D: int, dtype: torch.dtype, want_form: str) -> None:
    H, N, blocks = 2, 32, 4
    cache = torch.zeros(blocks, H, N, 2 * D, dtype=dtype)
    lay = layer(isa)
    form, _ = page_form(cache, lay, D, "l0")
    assert form == want_form, form
    write = writer_of(lay)
    assert write is not None
    certify(cache, form, D, write, "l0")
    for wrong in ("bhnc", "cpu_dn", "cpu_amx"):  # "bhnc": what the old connector read
        if wrong == form:
            continue
        try:
            certify(cache, wrong, D, write, "l0")
            raise AssertionError(f"{isa} pages certified as {wrong}")
        except LayoutError:
            pass
    T = blocks * N
    kv = (torch.randn(2, T, H, D) * 3).to(dtype)
    slots = torch.randperm(T)
    write(kv[0], kv[1], cache, slots)
    k, v = halves(cache, form, D)
    flat_k, flat_v = k.reshape(T, H, D), v.reshape(T, H, D)
    assert torch.equal(flat_k[slots], kv[0]) and torch.equal(flat_v[slots], kv[1])


def main() -> None:
    checked = []
    for isa, D, dtypes, form in (
        ("vec", 64, (torch.float32, torch.bfloat16, torch.float16), "cpu_dn"),
        ("vec16", 80, (torch.float32, torch.bfloat16, torch.float16), "cpu_dn"),
        ("amx", 64, (torch.bfloat16,), "cpu_amx"),
        ("amx", 128, (torch.bfloat16,), "cpu_amx"),
    ):
        for dtype in dtypes:
            check(isa, D, dtype, form)
            checked.append(f"{isa}/D{D}/{str(dtype).removeprefix('torch.')}")
    print(json.dumps({"checked": checked}))


if __name__ == "__main__":
    main()

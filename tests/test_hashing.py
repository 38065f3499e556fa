"""Namespace canonical bytes and prefix block hashes: vectors, determinism, sensitivity."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvstore.core.hashing import NAMESPACE_FIELDS, Namespace, block_hashes
from kvstore.errors import InvalidArgument

VECTORS = json.loads((Path(__file__).parent / "vectors" / "block_hashes.json").read_text())


def _ns(**kw: object) -> Namespace:
    base = dict(model="m", revision="r", num_layers=4, num_kv_heads=2, head_dim=8, block_tokens=4)
    base.update(kw)
    return Namespace(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: c["namespace"]["model"])
def test_checked_in_vectors(case: dict) -> None:
    ns = Namespace(**case["namespace"])
    assert ns.id.hex() == case["ns_id"]
    assert [h.hex() for h in block_hashes(ns, case["token_ids"])] == case["block_hashes"]


def test_chain_definition_by_hand() -> None:
    ns = _ns()
    toks = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    b0 = np.array(toks[:4], dtype="<u4").tobytes()
    b1 = np.array(toks[4:8], dtype="<u4").tobytes()
    h0 = xxhash.xxh3_128_digest(ns.id + b0)
    h1 = xxhash.xxh3_128_digest(h0 + b1)
    assert block_hashes(ns, toks) == [h0, h1]
    assert len(h0) == 16 and h0 == xxhash.xxh3_128(ns.id + b0).intdigest().to_bytes(16, "big")


def test_tail_block_not_hashed_and_prefix_property() -> None:
    ns = _ns()
    toks = list(range(23))
    hs = block_hashes(ns, toks)
    assert len(hs) == 5
    assert block_hashes(ns, toks[:20]) == hs
    assert block_hashes(ns, toks[:19]) == hs[:4]
    assert block_hashes(ns, toks[:3]) == []
    # Changing a token changes its block's hash and every later one, not the earlier ones.
    changed = block_hashes(ns, [*toks[:9], 999, *toks[10:]])
    assert changed[:2] == hs[:2] and all(a != b for a, b in zip(changed[2:], hs[2:], strict=True))


@pytest.mark.parametrize("name", NAMESPACE_FIELDS)
def test_every_namespace_field_changes_every_hash(name: str) -> None:
    ns = _ns(adapter="a", cache_salt="s")
    other_value = {
        "model": "m2",
        "revision": "r2",
        "adapter": "b",
        "cache_salt": "t",
        "num_layers": 5,
        "num_kv_heads": 3,
        "head_dim": 16,
        "dtype": "float16",
        "block_tokens": 4,  # replaced below: block_tokens changes the cut, keep tokens aligned
        "quant": "none",
        "tp_size": 2,
        "kv_format": 2,
    }[name]
    if name == "block_tokens":
        other = replace(ns, block_tokens=2)
        toks = list(range(16))
        first = block_hashes(ns, toks)
        second = block_hashes(other, toks)[1::2]  # same token boundaries
    else:
        other = replace(ns, **{name: other_value})
        toks = list(range(16))
        first, second = block_hashes(ns, toks), block_hashes(other, toks)
    assert other.id != ns.id
    assert all(a != b for a, b in zip(first, second, strict=True))


def test_optional_none_differs_from_value_and_dtype_aliases() -> None:
    assert _ns().id != _ns(adapter="x").id
    import torch

    assert _ns(dtype=torch.bfloat16) == _ns(dtype="bfloat16") == _ns(dtype="bf16")
    assert _ns(dtype=torch.bfloat16).id == _ns(dtype="bf16").id


def test_canonical_round_trip_and_garbage() -> None:
    plain = _ns(adapter="lora", tp_size=4, quant="none")
    assert Namespace.from_canonical_bytes(plain.canonical_bytes()) == plain
    # A salt travels as its digest: the parsed namespace has the id and the digest only.
    ns = _ns(adapter="lora", cache_salt="tenant-secret", tp_size=4, quant="none")
    assert b"tenant-secret" not in ns.canonical_bytes()
    parsed = Namespace.from_canonical_bytes(ns.canonical_bytes())
    assert (parsed.id, parsed.salt_digest, parsed.cache_salt) == (ns.id, ns.salt_digest, None)
    assert parsed.canonical_bytes() == ns.canonical_bytes()
    assert replace(parsed, cache_salt="tenant-secret") == ns
    not_a_digest = ns.canonical_bytes().replace(ns.salt_digest.encode(), b"x" * 32)
    for bad in (b"", b"junk", ns.canonical_bytes()[:-3], ns.canonical_bytes() + b"x",
                not_a_digest):  # fmt: skip
        with pytest.raises(InvalidArgument):
            Namespace.from_canonical_bytes(bad)


def test_token_inputs_equivalent_and_validated() -> None:
    import torch

    ns = _ns()
    toks = list(range(40, 80))
    ref = block_hashes(ns, toks)
    assert block_hashes(ns, np.array(toks, dtype=np.int64)) == ref
    assert block_hashes(ns, torch.tensor(toks, dtype=torch.int32)) == ref
    with pytest.raises(InvalidArgument):
        block_hashes(ns, [-1, 2, 3, 4])
    with pytest.raises(InvalidArgument):
        block_hashes(ns, [2**32, 2, 3, 4])
    with pytest.raises(InvalidArgument):
        block_hashes(ns, np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(InvalidArgument):
        block_hashes(ns, [0.5, 1.0, 2.0, 3.0])


@pytest.mark.parametrize(
    "kw", [{"num_layers": 0}, {"head_dim": -1}, {"quant": "fp8"}, {"dtype": "int8"}, {"model": ""}]
)
def test_invalid_namespace(kw: dict) -> None:
    with pytest.raises(InvalidArgument):
        _ns(**kw)


def test_deterministic_across_processes() -> None:
    """A fresh interpreter with another hash seed gets the same digests (no ``hash()``)."""
    case = VECTORS["cases"][0]
    code = (
        "import json,sys; from kvstore.core.hashing import Namespace, block_hashes;"
        "c=json.loads(sys.stdin.read()); ns=Namespace(**c['namespace']);"
        "print(','.join(h.hex() for h in block_hashes(ns, c['token_ids'])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(case),
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert out.stdout.strip().split(",") == case["block_hashes"]


def test_namespace_fields_are_all_hashed() -> None:
    declared = {f.name for f in fields(Namespace) if f.name not in ("id", "salt_digest")}
    assert declared == set(NAMESPACE_FIELDS)

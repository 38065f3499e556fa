"""INT4 namespaces through a real ``kvstore serve``: layers put and read back as the codec
decodes them, on both transports, and a node takes only INT4 chunks for an INT4 namespace
(an INT8 chunk of the right key is refused with a typed error and the honest writer then
stores the block)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import torch

import kvclient
from kvstore.core.codec import QUANT_SCHEMES, ChunkKey, chunk_nbytes, encode_blocks, read_header
from kvstore.core.kvgen import realistic_kv
from kvstore.dataplane import NodeClient, PutChunk
from kvstore.errors import BadShape, InvalidArgument
from tests.cluster import TRANSPORTS, Server, serving

H, D, B, LAYERS = 4, 64, 16, 2


def namespace(quant: str = "int4") -> kvclient.Namespace:
    return kvclient.Namespace(model=f"int4-{uuid.uuid4().hex[:8]}", revision="1",
                              num_layers=LAYERS, num_kv_heads=H, head_dim=D,
                              dtype=torch.bfloat16, block_tokens=B, quant=quant)  # fmt: skip


@pytest.fixture(scope="module", params=TRANSPORTS)
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    with serving("64MiB", request.param) as srv:
        yield srv


def layer_kv(tokens: int, layer: int) -> torch.Tensor:
    return realistic_kv(tokens, H, D, torch.bfloat16, seed=100 + layer)


def decoded(ns: kvclient.Namespace, tokens: list[int], layer: int) -> torch.Tensor:
    """What a reader must get back: the codec's own INT4 round trip of the layer's blocks."""
    keys = [ChunkKey(h, layer, 0) for h in kvclient.block_hashes(ns, tokens)]
    chunks = encode_blocks(layer_kv(len(tokens), layer), B, keys, ns.quant)
    assert all(read_header(c).scheme == QUANT_SCHEMES[ns.quant] for c in chunks)
    return torch.cat([kvclient.decode_chunk(c) for c in chunks], dim=1)


@pytest.mark.parametrize("quant", ["int4", "int4-g128"])
async def test_int4_layers_round_trip_through_the_pool(server: Server, quant: str) -> None:
    """The family (its default, int4-g32) or a scheme by name: the node sizes its slots and
    checks its chunks by it."""
    ns = namespace(quant)
    tokens = list(range(5 * B + 3))  # a partial last block is not stored
    async with await kvclient.KVClient.connect(server.grpc, ns, timeout_s=10) as kv:
        for layer in range(LAYERS):
            assert await kv.put_layer(tokens, layer, layer_kv(len(tokens), layer)) == 5 * B
        assert await kv.match_prefix(tokens) == 5 * B
        for layer in range(LAYERS):
            got = await kv.get_layer(tokens, layer)
            assert torch.equal(got, decoded(ns, tokens, layer))
            # and it is INT4, not a lossless copy
            assert not torch.equal(got, layer_kv(len(tokens), layer)[:, : 5 * B])


async def test_an_int4_namespace_refuses_an_int8_chunk_of_the_right_key(server: Server) -> None:
    ns = namespace()
    tokens = list(range(1000, 1000 + 2 * B))
    hashes = kvclient.block_hashes(ns, tokens)
    keys = [ChunkKey(h, 0, 0) for h in hashes]
    crafted = encode_blocks(layer_kv(len(tokens), 0), B, keys, "int8")
    assert crafted[0].numel() != chunk_nbytes(B, H, D, ns.dtype, ns.quant)
    spec = [PutChunk(h, hashes[i - 1] if i else None, 0, c.numel())
            for i, (h, c) in enumerate(zip(hashes, crafted, strict=True))]  # fmt: skip
    with pytest.raises(InvalidArgument, match="this namespace's chunks are"):
        await NodeClient(server.data).put(ns.canonical_bytes(), spec, crafted)
    async with await kvclient.KVClient.connect(server.grpc, ns, timeout_s=10) as kv:
        assert await kv.match_prefix(tokens) == 0
        assert await kv.put_layer(tokens, 0, layer_kv(len(tokens), 0)) == len(tokens)
        assert torch.equal(await kv.get_layer(tokens, 0), decoded(ns, tokens, 0))


def test_an_int4_namespace_needs_an_even_head_dim() -> None:
    with pytest.raises(BadShape, match="even"):
        chunk_nbytes(B, H, 65, torch.bfloat16, "int4")

"""The engine-facing client: the sync twin from many threads, start/wait handles,
cancellation without leaked pins, and partial misses reported block by block — against
real ``kvstore`` processes."""

from __future__ import annotations

import asyncio
import io
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

import kvclient
from kvclient.errors import BadShape, Cancelled, Closed, KVTimeout
from kvctl.main import main as kvctl
from kvstore.core.kvgen import realistic_kv
from tests import cluster
from tests.cluster import TRANSPORTS, Server, start_server

pytestmark = pytest.mark.slow

H, D = 8, 128


def _ns(layers: int = 4, revision: str = "r") -> kvclient.Namespace:
    return kvclient.Namespace(
        model="engine-test", revision=revision, num_layers=layers, num_kv_heads=H, head_dim=D,
        dtype=torch.bfloat16, block_tokens=256,
    )  # fmt: skip


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 150_000 for i in range(n)]


def node_stats(data_uri: str) -> dict:
    return asyncio.run(cluster.node_stats(data_uri))


@pytest.fixture(scope="module", params=TRANSPORTS)
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port", "0",
                       "--host-mem", "512MiB", "--transport", request.param)  # fmt: skip
    yield srv
    rc, out = srv.stop()
    assert rc == 0 and "pinned_slots=0" in out, out


def test_sync_client_from_eight_threads(server: Server) -> None:
    errors: list[BaseException] = []
    with kvclient.SyncKVClient.connect(server.grpc, _ns()) as kv:

        def work(i: int) -> None:
            try:
                tokens = _tokens(i, 768)
                for layer in range(4):
                    t = realistic_kv(768, H, D, torch.bfloat16, seed=i * 10 + layer)
                    assert kv.put_layer(tokens, layer, t) == 768
                for layer in range(4):
                    got = kv.get_layer(tokens, layer)
                    ref = realistic_kv(768, H, D, torch.bfloat16, seed=i * 10 + layer)
                    assert (got.float() - ref.float()).norm() / ref.float().norm() < 0.02
                assert kv.match_prefix(tokens) == 768
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not errors, errors
        assert not any(th.is_alive() for th in threads)
        assert node_stats(server.data)["pinned_slots"] == 0


def test_start_put_then_wait_while_caller_works(server: Server) -> None:
    with kvclient.SyncKVClient.connect(server.grpc, _ns()) as kv:
        tokens = _tokens(100, 2048)
        t = realistic_kv(2048, H, D, torch.bfloat16, seed=100)
        handle = kv.start_put_layer(tokens, 0, t)
        busy = torch.randn(256, 256)
        for _ in range(20):  # the caller computes the next layer meanwhile
            busy = busy @ busy.T / 256
        result = handle.wait(timeout=30)
        assert handle.done()
        assert result.tokens == 2048 and result.missing == []
        out = torch.zeros(2, 2048, H, D, dtype=torch.bfloat16)
        got = kv.start_get_layer(tokens, 0, out).wait(timeout=30)
        assert got.tokens == 2048 and got.missing == []
        assert torch.equal(out, kv.get_layer(tokens, 0))
        with pytest.raises(BadShape):
            kv.start_put_layer(tokens, 0, t[:, :100])
        # Not yet written: every block of layer 1 is reported missing, nothing raised.
        miss = kv.start_get_layer(tokens, 1, out).wait(timeout=30)
        assert miss.tokens == 0 and miss.missing == [(i, 1) for i in range(8)]


def test_stream_handle_waits_for_layers(server: Server) -> None:
    with kvclient.SyncKVClient.connect(server.grpc, _ns()) as kv:
        tokens = _tokens(200, 1024)
        stream = kv.start_stream_layers(tokens, timeout=30)
        with pytest.raises(KVTimeout):
            stream.layer(0, timeout=0.2)
        for layer in range(4):
            kv.put_layer(tokens, layer, realistic_kv(1024, H, D, torch.bfloat16, seed=layer))
        for layer in range(4):
            assert stream.layer(layer, timeout=30).shape == (2, 1024, H, D)
        assert stream.wait(timeout=30).tokens == 1024


def test_cancel_mid_transfer_leaves_no_pins(server: Server) -> None:
    with kvclient.SyncKVClient.connect(server.grpc, _ns(1)) as kv:
        tokens = _tokens(300, 64 * 256)  # 64 blocks: a 32 MiB int8 layer in flight
        t = realistic_kv(64 * 256, H, D, torch.bfloat16, seed=300)
        cancelled = 0
        for delay in (0.0, 0.005, 0.02, 0.05):
            handle = kv.start_put_layer(tokens, 0, t)
            time.sleep(delay)
            if handle.cancel():
                cancelled += 1
                with pytest.raises(Cancelled):
                    handle.wait(timeout=5)
            assert handle.done()
        assert cancelled >= 1
        out = torch.zeros(2, 64 * 256, H, D, dtype=torch.bfloat16)
        get = kv.start_get_layer(tokens, 0, out)
        get.cancel()
        assert get.done()
    deadline = time.monotonic() + 10
    while (stats := node_stats(server.data))["pinned_slots"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats["pinned_slots"] == 0 and stats["leases"] == 0, stats


def test_partial_miss_reported_block_by_block() -> None:
    """Two nodes share the blocks by HRW placement; one is killed: a get loads what the
    survivor holds and names exactly the blocks the dead node held."""
    # A lease of 6 s, not 1: a node is suspect (not placed on) after half a lease without a
    # heartbeat (one every third of a lease), and on a loaded machine a just-started node's
    # heartbeat came late by more than 0.5 s twice in CI (lease 1 s, then 3 s: all 16
    # blocks were placed on the other node); it must now be late by a second.
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                          "--node-lease-s", "6")  # fmt: skip
    nodes = []
    for i in range(2):
        args = ["--master", master.grpc, "--data-port", "0", "--metrics-port", "0",
                "--host-mem", "256MiB", "--node-id", f"n{i}"]  # fmt: skip
        nodes.append(start_server("node", *args))
    try:
        with kvclient.SyncKVClient.connect(master.grpc, _ns(2)) as kv:
            tokens = _tokens(400, 16 * 256)
            t = realistic_kv(16 * 256, H, D, torch.bfloat16, seed=400)
            assert kv.put_layer(tokens, 0, t) == 16 * 256
            held = [node_stats(n.data)["slots"] for n in nodes]
            assert all(held), "placement should spread 16 blocks over both nodes"
            nodes[1].kill()
            time.sleep(6.5)  # one lease: the master declares the node dead
            out = torch.zeros(2, 16 * 256, H, D, dtype=torch.bfloat16)
            result = kv.start_get_layer(tokens, 0, out).wait(timeout=30)
            missing = [i for i, _ in result.missing]
            assert len(missing) == held[1]
            assert result.tokens == held[0] * 256
            for i in range(16):
                block = out[:, i * 256 : (i + 1) * 256].float()
                if i in missing:
                    assert block.abs().sum() == 0
                else:
                    ref = t[:, i * 256 : (i + 1) * 256].float()
                    assert (block - ref).norm() / ref.norm() < 0.02
            prefix = kv.get_layer(tokens, 0).shape[1]
            assert prefix == (min(missing) if missing else 16) * 256
    finally:
        for n in nodes:
            n.kill()
        rc, out = master.stop()
        assert rc == 0, out


@pytest.mark.parametrize(
    ("layout", "engine_bs"), [("blocks_first", 16), ("kv_first", 16), ("kv_first", 512),
                              ("blocks_first", 96)]
)  # fmt: skip
def test_paged_round_trip_equals_contiguous(server: Server, layout: str, engine_bs: int) -> None:
    """Put from a paged cache with shuffled block ids, get into another paged cache: the
    tokens equal what the contiguous path returns, and no other engine block is touched."""
    n = 1024 + 100  # 4 full blocks of ours and a tail
    seed = 500 + engine_bs + len(layout)
    tokens = _tokens(seed, n)
    layer_kv = realistic_kv(n, H, D, torch.bfloat16, seed=seed)
    per_req = -(-n // engine_bs)
    num_blocks = per_req * 2 + 3
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=gen)[:per_req].tolist()

    def paged_from(kv: torch.Tensor) -> torch.Tensor:
        shape = (num_blocks, 2, engine_bs, H, D) if layout == "blocks_first" else (
            2, num_blocks, engine_bs, H, D)  # fmt: skip
        cache = torch.full(shape, 7.0, dtype=torch.bfloat16)
        for j, b in enumerate(ids):
            lo, hi = j * engine_bs, min(n, (j + 1) * engine_bs)
            dst = cache[b] if layout == "blocks_first" else cache[:, b]
            dst[:, : hi - lo] = kv[:, lo:hi]
        return cache

    def tokens_of(cache: torch.Tensor, count: int) -> torch.Tensor:
        parts = [cache[b] if layout == "blocks_first" else cache[:, b] for b in ids]
        return torch.cat(parts, dim=1)[:, :count]

    with kvclient.SyncKVClient.connect(server.grpc, _ns()) as kv:
        src = paged_from(layer_kv)
        assert kv.put_layer_paged(tokens, 2, src, ids, layout=layout) == 1024
        contiguous = kv.get_layer(tokens, 2)
        assert contiguous.shape[1] == 1024
        dst = torch.full_like(src, 7.0)
        assert kv.get_layer_paged(tokens, 2, dst, ids, layout=layout) == 1024
        assert torch.equal(tokens_of(dst, 1024), contiguous)
        # Engine blocks outside the request, and the request's tail, keep the sentinel.
        untouched = [b for b in range(num_blocks) if b not in ids]
        for b in untouched:
            blk = dst[b] if layout == "blocks_first" else dst[:, b]
            assert torch.all(blk == 7.0)
        assert torch.all(tokens_of(dst, n)[:, 1024:] == 7.0)
        # The handle variant reports the same tokens and no missing block.
        dst2 = torch.full_like(src, 7.0)
        res = kv.start_get_layer_paged(tokens, 2, dst2, ids, layout=layout).wait(timeout=30)
        assert res.tokens == 1024 and res.missing == []
        assert torch.equal(dst2, dst)
        with pytest.raises(BadShape):
            kv.put_layer_paged(tokens, 2, src[..., :64], ids, layout=layout)
        # Every layer at once: a bad cache among them raises before any layer is read, so
        # nothing is written into the engine's other caches behind the raise.
        for layer in range(4):
            kv.put_layer_paged(tokens, layer, src, ids, layout=layout)
        caches = [torch.full_like(src, 7.0) for _ in range(3)] + [src.float()]
        with pytest.raises(BadShape):
            kv.start_get_layers_paged(tokens, caches, ids, layout=layout)
        time.sleep(1.0)  # (what a read started behind the raise would have written by now)
        assert all(torch.all(c == 7.0) for c in caches[:3])
        caches[3] = torch.full_like(src, 7.0)
        for h in kv.start_get_layers_paged(tokens, caches, ids, layout=layout):
            assert h.wait(timeout=30).tokens == 1024
        assert torch.equal(tokens_of(caches[2], 1024), contiguous)
        # The blocking puts start their encode on this thread and bind their arguments
        # as the async methods do (keywords, defaults, and a TypeError for a bad call).
        again = paged_from(layer_kv)
        assert kv.put_layer_paged(tokens, 2, again, ids, layout, shard=0, timeout=30) == 1024
        assert kv.put_layer(tokens[:1024], 2, tokens_of(again, 1024), timeout=30) == 1024
        with pytest.raises(TypeError):
            kv.put_layer(tokens[:1024], 2, tokens_of(again, 1024), unknown=1)


def test_closing_a_writer_with_puts_in_flight_aborts_streams(server: Server) -> None:
    tokens = _tokens(600, 64 * 256)
    t = realistic_kv(64 * 256, H, D, torch.bfloat16, seed=600)
    with kvclient.SyncKVClient.connect(server.grpc, _ns(2)) as reader:
        stream = reader.start_stream_layers(tokens, timeout=60)
        writer = kvclient.SyncKVClient.connect(server.grpc, _ns(2))
        writer.start_put_layer(tokens, 0, t)  # 64 MiB of bf16 still quantizing ...
        writer.close()  # ... when the writer goes away
        t0 = time.monotonic()
        with pytest.raises(kvclient.errors.Miss, match="abort") as info:
            stream.layer(0, timeout=30)
        assert info.value.layer == 0
        assert time.monotonic() - t0 < 10  # told by the abort, not by the stream's timeout


def test_kvctl_evict_a_prompt_then_the_namespace(server: Server) -> None:
    # a namespace of its own: whatever other tests' puts stored (a cancel that came too
    # late stores its layer) is not this test's to count
    ns = _ns(1, revision="evict")
    flags = ["--model", ns.model, "--revision", ns.revision, "--layers", "1", "--kv-heads",
             str(H), "--head-dim", str(D), "--dtype", "bfloat16"]  # fmt: skip
    with kvclient.SyncKVClient.connect(server.grpc, ns) as kv:
        first, second = _tokens(700, 1024), _tokens(701, 512)
        for tokens in (first, second):
            assert kv.put_layer(tokens, 0, realistic_kv(len(tokens), H, D, torch.bfloat16)) > 0
        out = io.StringIO()
        args = ["--master", server.grpc, "evict", *flags, "--tokens", ",".join(map(str, first))]
        assert kvctl([*args, "--json"], stdout=out) == 0
        report = json.loads(out.getvalue())
        assert report["evicted"] == 4 and report["blocks"] == 4
        assert kv.match_prefix(first) == 0 and kv.get_layer(first, 0).shape[1] == 0
        assert kv.match_prefix(second) == 512  # other prompts untouched
        # A tenant named on a pool without tenants is refused, not read as the namespace
        # without one (it evicted that namespace's blocks).
        out = io.StringIO()
        assert kvctl(["--master", server.grpc, "evict", *flags, "--tenant", "bob"], stdout=out) == 1
        assert "names tenant 'bob', but this pool has no tenants" in out.getvalue()
        assert ": 0 slots evicted" in out.getvalue() and kv.match_prefix(second) == 512
        out = io.StringIO()
        assert kvctl(["--master", server.grpc, "evict", *flags], stdout=out) == 0
        assert "2 slots evicted" in out.getvalue()
        assert kv.match_prefix(second) == 0


def test_k_and_v_apart_short_out_and_streams_into_the_callers_memory(server: Server) -> None:
    """What an engine keeps: K and V in separate tensors, destinations sized to the hit, and
    streamed layers decoded straight into its own tensors or its paged cache."""
    n, B = 1024, 256
    tokens = _tokens(700, n + 50)
    layers = [realistic_kv(n + 50, H, D, torch.bfloat16, seed=700 + i) for i in range(4)]
    with kvclient.SyncKVClient.connect(server.grpc, _ns()) as kv:
        # Layers 0..2 put as (K, V) pairs, K a strided view: no stack anywhere.
        for layer in range(3):
            k = layers[layer][0].transpose(0, 1).contiguous().transpose(0, 1)
            assert kv.put_layer(tokens, layer, (k, layers[layer][1].clone())) == n
        stacked = kv.get_layer(tokens, 0)
        with kvclient.SyncKVClient.connect(server.grpc, _ns()) as other:
            assert other.put_layer(_tokens(701, n), 0, layers[0][:, :n]) == n
            assert torch.equal(other.get_layer(_tokens(701, n), 0), stacked)  # same bytes
        ko, vo = (
            torch.zeros(n, H, D, dtype=torch.bfloat16),
            torch.zeros(n, H, D, dtype=torch.bfloat16),
        )
        got = kv.get_layer(tokens, 0, out=(ko, vo))
        assert got[0].data_ptr() == ko.data_ptr() and torch.equal(ko, stacked[0])
        assert torch.equal(vo, stacked[1])
        # A destination holding fewer tokens than the prompt: only its whole blocks load.
        short = torch.zeros(2, 2 * B + 10, H, D, dtype=torch.bfloat16)
        part = kv.get_layer(tokens, 1, out=short)
        assert part.shape[1] == 2 * B and torch.equal(part, kv.get_layer(tokens, 1)[:, : 2 * B])
        res = kv.start_get_layer(tokens, 1, short).wait(timeout=30)
        assert res.tokens == 2 * B and res.missing == [(2, 1), (3, 1)]
        # A hit shorter than a larger out: a view of what loaded.
        half = tokens[: 2 * B]
        big = torch.zeros(2, n, H, D, dtype=torch.bfloat16)
        assert kv.get_layer(tokens[: 2 * B] + _tokens(9, n), 2, out=big).shape[1] == 2 * B
        assert kv.get_layer(half, 2, out=big).shape[1] == 2 * B
        # Streams into the caller's tensors, then into a paged cache.
        dests = [torch.full((2, n, H, D), 7.0, dtype=torch.bfloat16) for _ in range(4)]
        stream = kv.start_stream_layers(tokens, timeout=30, out=dests)
        paged = [torch.full((2, 80, 16, H, D), 7.0, dtype=torch.bfloat16) for _ in range(4)]
        ids = list(range(79, -1, -1))[: -(-len(tokens) // 16)]  # reversed: not one view
        into_paged = kv.start_stream_layers_paged(tokens, paged, ids, layout="kv_first", timeout=30)
        kv.put_layer(tokens, 3, layers[3])
        for layer in range(4):
            t = stream.layer(layer, timeout=30)
            assert t.data_ptr() == dests[layer].data_ptr() and t.shape[1] == n
            assert into_paged.layer(layer, timeout=30) == n
            want = kv.get_layer(tokens, layer)
            assert torch.equal(dests[layer], want)
            mine = torch.cat([paged[layer][:, b] for b in ids], dim=1)
            assert torch.equal(mine[:, :n], want) and bool((mine[:, n:] == 7).all())
        assert stream.wait(timeout=30).tokens == n and into_paged.wait(timeout=30).tokens == n
        pairs = [tuple(torch.empty(n, H, D, dtype=torch.bfloat16) for _ in "kv") for _ in dests]
        for layer, (k, v) in kv.stream_layers(tokens, timeout=30, out=pairs):
            assert k.data_ptr() == pairs[layer][0].data_ptr()
            assert torch.equal(torch.stack([k, v]), kv.get_layer(tokens, layer))
        with pytest.raises(BadShape):
            kv.start_stream_layers(tokens, out=dests[:3])
        with pytest.raises(BadShape):
            kv.start_stream_layers(tokens, out=[*dests[:3], dests[3][:, :B]])
        with pytest.raises(BadShape):
            kv.start_stream_layers_paged(tokens, paged[:2], ids, layout="kv_first")
        with pytest.raises(BadShape):
            kv.put_layer(tokens, 0, (layers[0][0], layers[0][1][:, :4]))


def test_calls_on_a_frozen_master_end_as_asked_and_close_ends_them_closed() -> None:
    """With the master frozen (SIGSTOP): a sync call's KVTimeout is the call's own (its
    deadline named), not one of the loop's with the client's limit and a grace; and calls
    in flight when the client is closed (sync calls from other threads, an async client's
    task) end with Closed, not a bare cancellation that escapes ``except Exception``."""
    srv = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port", "0",
                       "--host-mem", "64MiB")  # fmt: skip
    tokens = _tokens(31, 512)
    try:
        kv = kvclient.SyncKVClient.connect(srv.grpc, _ns(), timeout_s=3)
        srv.proc.send_signal(signal.SIGSTOP)
        with pytest.raises(KVTimeout, match="match_prefix did not complete within 1 s"):
            kv.match_prefix(tokens, timeout=1)
        began = time.monotonic()  # a put's deadline holds: its ABORT goes on behind it
        with pytest.raises(KVTimeout, match="put_layer did not complete within 1 s"):
            kv.put_layer(tokens, 0, realistic_kv(512, H, D, torch.bfloat16), timeout=1)
        assert time.monotonic() - began < 1.9  # (it took 3 s: 2 more for the ABORT)
        errors: dict[str, BaseException] = {}

        def call(name: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except BaseException as exc:  # (what each call ended with)
                errors[name] = exc

        calls = {"get_object": lambda: kv.get_object("k"), "match": lambda: kv.match_prefix(tokens)}
        threads = [threading.Thread(target=call, args=item) for item in calls.items()]
        for t in threads:
            t.start()
        time.sleep(0.5)  # (both wait on the frozen master)
        kv.close()
        for t in threads:
            t.join(10)
        assert {n: type(e) for n, e in errors.items()} == {n: Closed for n in calls}
        srv.proc.send_signal(signal.SIGCONT)
        assert asyncio.run(_closed_under(srv)) is Closed
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.stop()


async def _closed_under(srv: Server) -> type:
    """What an async client's task waiting on ``srv``'s master, frozen, ends with when the
    client is closed."""
    kv = await kvclient.KVClient.connect(srv.grpc, _ns(), timeout_s=3)
    srv.proc.send_signal(signal.SIGSTOP)
    task = asyncio.create_task(kv.get_object("k"))
    await asyncio.sleep(0.3)
    await kv.close()
    try:
        await asyncio.wait_for(task, 10)
    except BaseException as exc:
        return type(exc)
    return type(None)

"""End to end over real processes on loopback: ``kvstore serve`` as a subprocess, writer
and reader in their own processes, real gRPC, the real ``tcp://`` data plane."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvclient
from kvclient.errors import (
    BadShape,
    CapacityError,
    KVStoreError,
    KVTimeout,
    ProtocolError,
    Unreachable,
)
from kvstore.control.client import MasterClient
from kvstore.core.codec import decode_chunk, encode_chunk
from kvstore.core.kvgen import realistic_kv
from kvstore.dataplane.messages import Ack, expect
from kvstore.transport import connect
from tests.cluster import TRANSPORTS, Server, node_stats, start_server
from tests.kvproc import layer_kv, namespace, prompt

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Every test runs once per real data-plane transport."""
    return str(request.param)


def serve(transport: str, host_mem: str) -> Server:
    """``kvstore serve`` on free ports with the given transport and pool size."""
    return start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port", "0",
                        "--host-mem", host_mem, "--transport", transport)  # fmt: skip


@pytest.fixture(scope="module")
def server(transport: str) -> Iterator[Server]:
    srv = serve(transport, "512MiB")
    yield srv
    rc, out = srv.stop()
    assert rc == 0, out
    assert "kvstore stopped pinned_slots=0" in out, out


def _proc(role: str, master: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "kvproc.py"), role, master, *extra],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(HERE.parent)),
    )


def _events(proc: subprocess.Popen[str], timeout: float = 120) -> list[dict]:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_stream_while_writing_across_processes(server: Server) -> None:
    """The reader starts first; layer 0 reaches it before the writer starts its last
    layer; every layer decodes within the int8 error bound."""
    layers = 32
    reader = _proc("reader", server.grpc, "--layers", str(layers), "--seed", "11")
    assert reader.stdout is not None
    first = json.loads(reader.stdout.readline())  # connected and about to watch
    assert first.get("ready") is True
    writer = _proc("writer", server.grpc, "--layers", str(layers), "--seed", "11",
                   "--pause-s", "0.05")  # fmt: skip
    wrote = _events(writer)
    got = [first, *_events(reader)]
    stored = [e["stored"] for e in wrote if e.get("phase") == "done"]
    assert stored == [2048] * layers
    arrivals = [e for e in got if "got" in e]
    assert [e["got"] for e in arrivals] == list(range(layers))
    assert all(e["tokens"] == 2048 for e in arrivals)
    assert max(e["err"] for e in arrivals) <= 0.015
    last_start = next(e["t"] for e in wrote if e.get("put") == layers - 1)
    assert arrivals[0]["t"] < last_start


async def test_match_prefix_and_get_from_a_third_process(server: Server) -> None:
    """A writer process stores a prompt with a partial tail; this process matches and
    reads it back."""
    n, layers = 1000, 4  # 3 full blocks + a 232-token tail
    wrote = _events(_proc("writer", server.grpc, "--tokens", str(n), "--layers", str(layers),
                          "--seed", "21"))  # fmt: skip
    assert [e["stored"] for e in wrote if e.get("phase") == "done"] == [768] * layers
    tokens = prompt(n, 21)
    async with await kvclient.KVClient.connect(server.grpc, namespace(layers)) as kv:
        assert await kv.match_prefix(tokens) == 768
        assert await kv.match_prefix(tokens[:700]) == 512
        other = [*tokens[:300], 7, *tokens[301:]]
        assert await kv.match_prefix(other) == 256  # diverges inside block 1
        assert await kv.match_prefix(prompt(n, 99)) == 0
        for layer in range(layers):
            t = await kv.get_layer(tokens, layer)
            assert t.shape == (2, 768, 8, 128) and t.dtype == torch.bfloat16
            ref = layer_kv(n, layer, 21)[:, :768].float()
            assert (t.float() - ref).norm() / ref.norm() < 0.02
        out = torch.zeros(2, 1024, 8, 128, dtype=torch.bfloat16)
        view = await kv.get_layer(tokens, 2, out=out)
        assert view.data_ptr() == out.data_ptr() and view.shape[1] == 768
        assert torch.equal(view, await kv.get_layer(tokens, 2))
        assert out[:, 768:].abs().sum() == 0
        assert (await kv.get_layer(prompt(n, 98), 0)).shape == (2, 0, 8, 128)
        # Held match: the slots are pinned on the node until the hold expires.
        assert await kv.match_prefix(tokens, hold_s=0.5) == 768


async def test_objects_and_bad_input(server: Server) -> None:
    ns = namespace(2)
    async with await kvclient.KVClient.connect(server.grpc, ns, timeout_s=10) as kv:
        value = os.urandom(3 * 2**20 + 17)
        assert not await kv.exists("cfg/a")
        assert await kv.get_object("cfg/a") is None
        await kv.put_object("cfg/a", value)
        assert await kv.exists("cfg/a")
        assert await kv.get_object("cfg/a") == value
        await kv.put_object("cfg/a", b"second")
        assert await kv.get_object("cfg/a") == b"second"
        assert await kv.remove("cfg/a") is True
        assert await kv.remove("cfg/a") is False
        assert await kv.get_object("cfg/a") is None
        with pytest.raises(CapacityError):
            await kv.put_object("big", bytes(kv.max_object_bytes + 1))
        tokens = list(range(512))
        with pytest.raises(BadShape):
            await kv.put_layer(tokens, 0, torch.zeros(2, 512, 8, 64, dtype=torch.bfloat16))
        with pytest.raises(BadShape):
            await kv.put_layer(tokens, 0, torch.zeros(2, 500, 8, 128, dtype=torch.bfloat16))
        with pytest.raises(BadShape):
            await kv.put_layer(tokens, 0, torch.zeros(2, 512, 8, 128, dtype=torch.float16))
        with pytest.raises(KVStoreError):
            await kv.put_layer(tokens, 5, torch.zeros(2, 512, 8, 128, dtype=torch.bfloat16))
        # The server goes on serving.
        t = realistic_kv(512, 8, 128, torch.bfloat16, seed=5)
        assert await kv.put_layer(tokens, 1, t) == 512
        assert (await kv.get_layer(tokens, 1)).shape[1] == 512


async def test_garbage_on_ports_leaves_server_serving(server: Server) -> None:
    host, port = server.data.removeprefix("tcp://").rsplit(":", 1)
    ghost, gport = server.grpc.rsplit(":", 1)
    junk = os.urandom(64 * 1024)
    for addr in ((host, int(port)), (ghost, int(gport))):
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(junk)
            s.settimeout(5)
            try:
                while s.recv(65536):
                    pass
            except (TimeoutError, ConnectionResetError):
                pass
    ns = namespace(1)
    async with await kvclient.KVClient.connect(server.grpc, ns) as kv:
        tokens = list(range(1000, 1256))
        t = realistic_kv(256, 8, 128, torch.bfloat16, seed=9)
        assert await kv.put_layer(tokens, 0, t) == 256
        assert await kv.match_prefix(tokens) == 256


def test_metrics_endpoint(server: Server, transport: str) -> None:
    body = urllib.request.urlopen(f"http://{server.addresses['metrics']}/metrics", timeout=5)
    text = body.read().decode()
    for name in (
        "kvstore_pool_bytes",
        "kvstore_blocks",
        "kvstore_prefix_lookups_total",
        "kvstore_prefix_hit_tokens_total",
        "kvstore_transfer_bytes_total",
        "kvstore_transfer_seconds",
        "kvstore_evictions_total",
        "kvstore_stale_misses_total",
        "kvstore_rpc_seconds",
    ):
        assert name in text, name
    # ucx:// gets READ committed slots directly: the node serves (and counts) none of them.
    for op in ("put", "get") if transport == "tcp" else ("put",):
        assert f'kvstore_transfer_bytes_total{{op="{op}",transport="{transport}"}}' in text


def test_a_master_alone_exports_only_the_metrics_it_owns() -> None:
    """``kvstore master`` runs no node: no node metric on its /metrics, not even at 0 (it
    exported the node's unlabelled ones, an empty disk tier among them)."""
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0")
    try:
        url = f"http://{master.addresses['metrics']}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        master.stop()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE kvstore")}
    assert {"kvstore_nodes", "kvstore_rpc_seconds", "kvstore_blocks"} <= names
    assert {"kvstore_prefix_lookups_total", "kvstore_prefix_hit_tokens_total"} <= names
    node_owned = {"kvstore_disk_blocks", "kvstore_stale_misses_total", "kvstore_pool_bytes",
                  "kvstore_transfer_bytes_total", "kvstore_transfer_errors_total"}  # fmt: skip
    assert not names & node_owned, names & node_owned


def test_a_node_alone_exports_no_metric_of_the_masters() -> None:
    """``kvstore node`` runs no master: no master metric on its /metrics (it listed the
    master's node states and RPC times with no sample)."""
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0")
    try:
        node = start_server("node", "--master", master.grpc, "--data-port", "0",
                            "--metrics-port", "0", "--host-mem", "32MiB")  # fmt: skip
        try:
            url = f"http://{node.addresses['metrics']}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        finally:
            node.stop()
    finally:
        master.stop()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE kvstore")}
    assert {"kvstore_pool_bytes", "kvstore_transfer_bytes_total", "kvstore_blocks"} <= names
    assert not names & {"kvstore_nodes", "kvstore_rpc_seconds"}, names


async def test_killed_server_gives_typed_error_within_timeout(transport: str) -> None:
    srv = serve(transport, "64MiB")
    ns = namespace(1)
    tokens = list(range(256))
    try:
        kv = await kvclient.KVClient.connect(srv.grpc, ns, timeout_s=3)
        assert await kv.put_layer(tokens, 0, realistic_kv(256, 8, 128, torch.bfloat16)) == 256
    finally:
        srv.kill()
    t0 = time.monotonic()
    with pytest.raises((Unreachable, KVTimeout)):
        await kv.get_layer(tokens, 0)
    assert time.monotonic() - t0 < 3 + 2
    await kv.close()


async def test_full_pool_evicts_without_corrupting_reads(transport: str) -> None:
    """A 48 MiB pool holds 5 blocks of this namespace; writing 24 evicts the oldest
    while a reader keeps reading: every read returns a correct prefix (maybe short)."""
    srv = serve(transport, "48MiB")
    ns = namespace(16)  # 16 layers x ~0.5 MiB = 8 MiB per slot
    try:
        async with await kvclient.KVClient.connect(srv.grpc, ns) as kv:
            prompts = [prompt(256, 100 + i) for i in range(24)]
            kvs = [realistic_kv(256, 8, 128, torch.bfloat16, seed=100 + i) for i in range(24)]
            stop = asyncio.Event()
            checked = 0

            async def read_loop() -> None:
                nonlocal checked
                while not stop.is_set():
                    for i in range(24):
                        t = await kv.get_layer(prompts[i], 3)
                        if t.shape[1]:
                            err = (t.float() - kvs[i][:, :256].float()).norm() / kvs[
                                i
                            ].float().norm()
                            assert err < 0.02, (i, float(err))
                            checked += 1
                    await asyncio.sleep(0)

            reader = asyncio.create_task(read_loop())
            for i in range(24):
                for layer in range(16):
                    assert await kv.put_layer(prompts[i], layer, kvs[i]) == 256
            stop.set()
            await reader
            assert checked > 0
            present = [await kv.match_prefix(p) for p in prompts]
            assert present[-1] == 256 and present[0] == 0
            assert sum(1 for p in present if p) <= 5
    finally:
        rc, out = srv.stop()
    assert rc == 0 and "pinned_slots=0" in out


def _put_bytes(server: Server, transport: str) -> float:
    """Chunk bytes the node has received in puts over ``transport`` (its /metrics)."""
    body = urllib.request.urlopen(f"http://{server.addresses['metrics']}/metrics", timeout=5)
    for line in body.read().decode().splitlines():
        if line.startswith(f'kvstore_transfer_bytes_total{{op="put",transport="{transport}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_put_skips_blocks_a_held_match_pinned(server: Server, transport: str) -> None:
    """After ``match_prefix(hold_s=...)`` pinned a prefix, a put of those blocks encodes
    and sends nothing for them (they are stored and cannot be evicted) and still counts
    them stored; the blocks after the prefix go out as usual."""
    ns = namespace(2)
    tokens = prompt(512 + 256, seed=31)
    async with await kvclient.KVClient.connect(server.grpc, ns) as kv:
        for layer in range(2):
            assert await kv.put_layer(tokens[:512], layer, layer_kv(512, layer, 31)) == 512
        assert await kv.match_prefix(tokens, hold_s=30) == 512
        before = _put_bytes(server, transport)
        poison = torch.full((2, 512, 8, 128), float("nan"), dtype=torch.bfloat16)
        assert await kv.put_layer(tokens[:512], 1, poison) == 512  # nothing encoded: no NaN
        assert _put_bytes(server, transport) == before
        assert await kv.put_layer(tokens, 0, layer_kv(768, 0, 31)) == 768
        assert _put_bytes(server, transport) > before  # only the third block was sent
        got = await kv.get_layer(tokens, 1)
        assert torch.equal(got, await kv.get_layer(tokens[:512], 1)) and got.shape[1] == 512
    async with await kvclient.KVClient.connect(server.grpc, ns) as other:  # no holds of its own
        with pytest.raises(kvclient.errors.KVStoreError):
            await other.put_layer(tokens[:512], 1, poison)


async def test_small_host_codec_work_runs_on_the_loop(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put and a get of at most ``INLINE_CODEC_BYTES`` of host chunks encode and decode on
    the client's loop (the codec thread's hand-off costs more than such work); larger ones
    on the codec thread. Either way the pool gives back what a local encode and decode of
    each block gives."""
    seen: list[tuple[str, str]] = []
    real_encode, real_decode = kvclient.client.encode_blocks, kvclient.reads.ChunkReader._decode_all

    def encode(*args: object, **kwargs: object) -> object:
        seen.append(("encode", threading.current_thread().name))
        return real_encode(*args, **kwargs)  # type: ignore[arg-type]

    def decode(*args: object, **kwargs: object) -> object:
        seen.append(("decode", threading.current_thread().name))
        return real_decode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kvclient.client, "encode_blocks", encode)
    monkeypatch.setattr(kvclient.reads.ChunkReader, "_decode_all", decode)
    ns = kvclient.Namespace(
        model="itest-inline", revision="r1", num_layers=1, num_kv_heads=8, head_dim=128,
        dtype=torch.bfloat16, block_tokens=16, quant="int8",
    )  # fmt: skip
    chunk = kvclient.client.chunk_nbytes(16, 8, 128, torch.bfloat16, "int8")
    few = kvclient.client.INLINE_CODEC_BYTES // chunk
    loop = threading.current_thread().name
    async with await kvclient.KVClient.connect(server.grpc, ns) as kv:
        for blocks, where in ((few, loop), (few + 1, "kvclient-codec")):
            seen.clear()
            tokens, kv_in = prompt(16 * blocks, seed=blocks), layer_kv(16 * blocks, 0, blocks)
            assert await kv.put_layer(tokens, 0, kv_in) == 16 * blocks
            got = await kv.get_layer(tokens, 0)
            assert [op for op, _ in seen] == ["encode", "decode"], seen
            assert all(name.startswith(where) for _, name in seen), (blocks, seen)
            want = torch.cat([decode_chunk(encode_chunk(kv_in[:, 16 * i : 16 * (i + 1)]))
                              for i in range(blocks)], dim=1)  # fmt: skip
            assert torch.equal(got, want)


def _samples(server: Server) -> dict[str, float]:
    """Every sample of the server's /metrics, by its name and labels as exposed."""
    body = urllib.request.urlopen(f"http://{server.addresses['metrics']}/metrics", timeout=5)
    out = {}
    for line in body.read().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def test_metrics_count_errors_nodes_blocks_and_misses(server: Server, transport: str) -> None:
    """What operators alert on is exported: refused and failed exchanges and rejected
    chunks by op and reason, the nodes the master knows by state, the blocks in the index,
    and the tokens match_prefix did not find."""
    before = _samples(server)
    conn = await connect(server.data, timeout=5)
    await conn.send({"op": "no-such-op"}, timeout=5)
    with pytest.raises(ProtocolError):
        expect((await conn.recv_header(5)).header, Ack)
    await conn.close()
    ns = namespace(1)
    tokens = prompt(512, seed=77)
    async with await kvclient.KVClient.connect(server.grpc, ns) as kv:
        assert await kv.match_prefix(tokens) == 0
        assert await kv.put_layer(tokens[:256], 0, layer_kv(256, 0, 77)) == 256
        assert await kv.match_prefix(tokens) == 256
    errors = 'kvstore_transfer_errors_total{op="other",reason="protocol",transport="tcp"}'
    missed = "kvstore_prefix_miss_tokens_total"
    deadline = time.monotonic() + 10  # gauges are set after each lease sweep (1 s)
    while (now := _samples(server)).get('kvstore_blocks{role="master"}', 0) < 1:
        assert time.monotonic() < deadline, now
        await asyncio.sleep(0.2)
    assert now[errors] == before.get(errors, 0) + 1
    assert now[missed] == before.get(missed, 0) + 512 + 256
    assert now['kvstore_nodes{state="alive"}'] == 1 and now['kvstore_nodes{state="dead"}'] == 0


async def test_nodes_report_their_counters_with_each_heartbeat(server: Server) -> None:
    """A node's own counters (slots, pins, claims, grants, scrub) reach the master with its
    heartbeats, and ``Nodes()`` hands them out."""
    async with MasterClient(server.grpc, timeout_s=5) as mc:
        deadline = time.monotonic() + 10  # heartbeats every lease / 3 (10 s lease)
        while not (node := (await mc.nodes())[0]).counters:
            assert time.monotonic() < deadline, node
            await asyncio.sleep(0.2)
    stats = await node_stats(server.data)
    assert {"slots", "pinned_slots", "inflight", "grants", "scrubbed"} <= set(node.counters)
    assert all(type(v) is int for v in node.counters.values()) and "node_id" not in node.counters
    assert node.counters["slots"] >= 0 and stats["slots"] >= 0


async def test_pool_usage_follows_each_put_not_the_next_heartbeat(server: Server) -> None:
    """``kvctl status`` used bytes right after a put equal what the node holds: nodes report
    their tier usage with every commit, not only with heartbeats (every lease / 3)."""
    ns = namespace(layers=1)
    kv = await kvclient.KVClient.connect(server.grpc, ns)
    async with MasterClient(server.grpc, timeout_s=5) as mc, kv:
        for round_ in range(3):
            before = (await mc.stats()).used_bytes
            tokens = prompt(512, 9100 + round_)  # fresh blocks every round
            assert await kv.put_layer(tokens, 0, layer_kv(512, 0, 9100 + round_)) == 512
            after = (await mc.stats()).used_bytes
            held = (await node_stats(server.data))["used_bytes"]
            assert after > before and after == held, (before, after, held)

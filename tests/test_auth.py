"""Tokens and roles on the control plane, with real processes: a master and a node started
with one auth file (``--auth-file``), clients and kvctl with tokens, and the attacks of a
plain ``grpc.aio`` channel — a Register, Commit, Drain or Abort without the right token —
refused with UNAUTHENTICATED or PERMISSION_DENIED before any handler runs, while the pool
keeps serving its clients. Without an auth file a server binds loopback only (its ready
line says ``auth=off``) unless ``--insecure``; an auth file others can read is refused."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import kvclient
from kvstore.control.client import MasterClient
from kvstore.control.records import BlockAdd, CommitBatch
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.authfile import ADMIN, CLIENT, SECRET, write_auth_file
from tests.cluster import Server, run_kvctl, start_server
from tests.kvproc import layer_kv, namespace, prompt

pytestmark = pytest.mark.slow


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[Server, Server, Path]]:
    auth = write_auth_file(tmp_path)
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                          "--node-lease-s", "3", "--auth-file", str(auth))  # fmt: skip
    node = start_server("node", "--master", master.grpc, "--data-port", "0", "--metrics-port",
                        "0", "--host-mem", "64MiB", "--auth-file", str(auth))  # fmt: skip
    try:
        yield master, node, tmp_path
    finally:
        node.stop()
        master.stop()


async def _live_nodes(master: Server) -> int:
    async with MasterClient(master.grpc, token=ADMIN) as admin:
        return sum(n.alive for n in await admin.nodes())


async def test_tokens_open_the_pool_and_nothing_else_does(
    pool: tuple[Server, Server, Path],
) -> None:
    master, _, _ = pool
    deadline = time.monotonic() + 10
    while await _live_nodes(master) < 1:  # the node's secret opened Register and Heartbeat
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    tokens = prompt(1024, seed=61)
    async with await kvclient.KVClient.connect(master.grpc, namespace(1), token=CLIENT) as kv:
        assert await kv.put_layer(tokens, 0, layer_kv(1024, 0, 61)) == 1024
        assert await kv.match_prefix(tokens) == 1024
        assert (await kv.get_layer(tokens, 0)).shape[1] == 1024
    for token in ("", "not-a-token-but-long-enough"):
        with pytest.raises(kvclient.errors.Unauthorized, match="no valid token"):
            await kvclient.KVClient.connect(master.grpc, namespace(1), token=token)
    await asyncio.sleep(2 * 3)  # two leases: heartbeats carry the secret too
    assert await _live_nodes(master) == 1


async def test_forged_control_calls_are_refused(pool: tuple[Server, Server, Path]) -> None:
    """What anyone reaching the port could do before: re-register a live node's id, commit a
    prompt never written, drain a node, abort another tenant's stream."""
    master, node, _ = pool
    node_id = node.addresses["node"]
    tokens = prompt(1024, seed=62)
    async with await kvclient.KVClient.connect(master.grpc, namespace(1), token=CLIENT) as kv:
        assert await kv.put_layer(tokens, 0, layer_kv(1024, 0, 62)) == 1024
        hashes = kv.block_hashes(tokens)
        async with grpc.aio.insecure_channel(master.grpc) as channel:
            stub = pb_grpc.MasterStub(channel)
            attacks = [
                ("Register", pb.RegisterRequest(node_id=node_id, data_uri="tcp://10.9.9.9:1")),
                ("Commit", pb.CommitRequest(node_id=node_id, epoch=1, seq=1, adds=[
                    pb.BlockAdd(ns_id=kv.ns.id, block_hash=b"\x01" * 16, chunks=[0])])),
                ("Drain", pb.DrainRequest(node_id=node_id)),
                ("Abort", pb.AbortRequest(ns_id=kv.ns.id, block_hashes=hashes, reason="x")),
            ]  # fmt: skip
            for method, request in attacks:
                for token, code in (
                    ("", grpc.StatusCode.UNAUTHENTICATED),
                    ("wrong-token-0123456789", grpc.StatusCode.UNAUTHENTICATED),
                    (CLIENT if method != "Abort" else None, grpc.StatusCode.PERMISSION_DENIED),
                ):
                    if token is None:
                        continue
                    metadata = (("authorization", f"Bearer {token}"),) if token else ()
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await getattr(stub, method)(request, timeout=5, metadata=metadata)
                    assert err.value.code() == code, (method, token, err.value)
                    if method == "Commit":  # and a commit stream, refused as it opens
                        # (read, not write then read: a write that loses the race with the
                        # refusal ends the call with gRPC's own INTERNAL, not the status)
                        stream = stub.CommitStream(timeout=5, metadata=metadata)
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await stream.read()
                        assert err.value.code() == code, ("CommitStream", token, err.value)
        # Nothing changed: the node is not draining, the prompt still matches, in full.
        async with MasterClient(master.grpc, token=ADMIN) as admin:
            [info] = [n for n in await admin.nodes() if n.node_id == node_id]
            assert info.alive and not info.draining
        assert await kv.match_prefix(tokens) == 1024
        assert (await kv.get_layer(tokens, 0)).shape[1] == 1024


async def test_the_cluster_secret_alone_cannot_take_over_a_live_node(
    pool: tuple[Server, Server, Path],
) -> None:
    """A process holding the cluster secret (a node role) but not the live node's
    registration key: it cannot register the node's id elsewhere (ALREADY_EXISTS), nor
    heartbeat, commit for, deregister or drain it (PERMISSION_DENIED), though Nodes shows
    its epoch; the node serves on, not draining."""
    master, node, _ = pool
    node_id = node.addresses["node"]
    tokens = prompt(1024, seed=63)
    async with await kvclient.KVClient.connect(master.grpc, namespace(1), token=CLIENT) as kv:
        assert await kv.put_layer(tokens, 0, layer_kv(1024, 0, 63)) == 1024
        async with MasterClient(master.grpc, token=SECRET) as rogue:
            [info] = [n for n in await rogue.nodes() if n.node_id == node_id]
            rogue.session = b"\x5a" * 32
            with pytest.raises(kvclient.errors.NodeIdTaken):
                await rogue.register(node_id, "tcp://10.9.9.9:1")
            with pytest.raises(kvclient.errors.PermissionDenied):
                await rogue.heartbeat(node_id, info.epoch)
            with pytest.raises(kvclient.errors.PermissionDenied):
                await rogue.commit(CommitBatch(node_id, info.epoch, 10**6, (
                    BlockAdd(kv.ns.id, b"\x01" * 16, (0,)),)))  # fmt: skip
            with pytest.raises(kvclient.errors.PermissionDenied):
                await rogue.deregister(node_id, info.epoch)
            with pytest.raises(kvclient.errors.PermissionDenied):  # a node drains only itself
                await rogue.drain(node_id)
            [after] = [n for n in await rogue.nodes() if n.node_id == node_id]
            assert (after.epoch, after.data_uri, after.alive) == (info.epoch, info.data_uri, True)
            assert not after.draining
        assert await kv.match_prefix(tokens) == 1024
        assert (await kv.get_layer(tokens, 0)).shape[1] == 1024


def test_kvctl_takes_its_token_from_a_file_or_the_environment(
    pool: tuple[Server, Server, Path],
) -> None:
    master, node, tmp = pool
    node_id = node.addresses["node"]
    refused = run_kvctl(master, "status")
    assert refused.returncode == 1 and "no valid token" in refused.stderr, refused.stderr
    token_file = tmp / "admin.token"
    token_file.write_text(ADMIN + "\n")
    assert run_kvctl(master, "--token-file", str(token_file), "status").returncode == 0
    client = run_kvctl(master, "drain", node_id, env={"KVSTORE_TOKEN": CLIENT})
    assert client.returncode == 1 and "not allowed for role client" in client.stderr
    admin = run_kvctl(master, "drain", node_id, env={"KVSTORE_TOKEN_FILE": str(token_file)})
    assert admin.returncode == 0, admin.stderr
    undrain = run_kvctl(master, "drain", node_id, "--undrain", env={"KVSTORE_TOKEN": ADMIN})
    assert undrain.returncode == 0, undrain.stderr
    missing = run_kvctl(master, "--token-file", str(tmp / "nope"), "status")
    assert missing.returncode == 2 and "token file" in missing.stderr


def _kvstore(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *argv], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


def test_a_server_without_secrets_binds_loopback_only(tmp_path: Path) -> None:
    exposed = _kvstore("serve", "--host", "0.0.0.0", "--grpc-port", "0", "--data-port", "0",
                       "--metrics-port", "0")  # fmt: skip
    assert exposed.returncode == 2
    assert "not a loopback address and no --auth-file" in exposed.stderr, exposed.stderr
    loose = write_auth_file(tmp_path, mode=0o644)
    refused = _kvstore("master", "--grpc-port", "0", "--auth-file", str(loose))
    assert refused.returncode == 2 and "chmod 600" in refused.stderr, refused.stderr
    srv = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port", "0",
                       "--host-mem", "64MiB")  # fmt: skip
    try:
        assert srv.addresses["auth"] == "off"
    finally:
        srv.stop()


async def test_serve_with_an_auth_file_keeps_its_own_node(tmp_path: Path) -> None:
    """``kvstore serve``'s node commits in process but heartbeats over gRPC: with the
    cluster secret, so it stays alive past its lease."""
    auth = write_auth_file(tmp_path)
    srv = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port", "0",
                       "--host-mem", "64MiB", "--node-lease-s", "1.5",
                       "--auth-file", str(auth))  # fmt: skip
    try:
        assert srv.addresses["auth"] == "on"
        await asyncio.sleep(3 * 1.5)
        assert await _live_nodes(srv) == 1
        tokens = prompt(512, seed=63)
        async with await kvclient.KVClient.connect(srv.grpc, namespace(1), token=CLIENT) as kv:
            assert await kv.put_layer(tokens, 0, layer_kv(512, 0, 63)) == 512
    finally:
        rc, out = srv.stop()
        assert rc == 0 and "pinned_slots=0" in out, out

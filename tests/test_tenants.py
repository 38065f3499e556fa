"""Tenants the servers enforce, with real processes: a master and a node started with one
auth file that names two client tenants. Both send the same namespace and the same prompt
(so the same block hashes, whatever ``cache_salt`` says); neither can read, overwrite,
abort, evict or list the other's KV or objects, and a client that names another tenant on
a data port is refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
import torch

import kvclient
from kvstore.control.client import MasterClient
from kvstore.control.records import ClusterEventKind
from kvstore.dataplane import NodeClient
from kvstore.dataplane.client import Dial
from kvstore.dataplane.messages import PutChunk
from kvstore.errors import Miss, PermissionDenied
from tests.authfile import ADMIN, CLIENT, CLIENT_B, write_auth_file
from tests.cluster import Server, run_kvctl, start_server
from tests.kvproc import HEAD_DIM, HEADS, layer_kv, namespace, prompt

pytestmark = pytest.mark.slow

NS = namespace(1)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    auth = write_auth_file(tmp_path_factory.mktemp("tenants"))
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                          "--auth-file", str(auth))  # fmt: skip
    try:
        node = start_server("node", "--master", master.grpc, "--data-port", "0",
                            "--metrics-port", "0", "--host-mem", "64MiB",
                            "--auth-file", str(auth))  # fmt: skip
    except BaseException:
        master.stop()
        raise
    yield master, node
    node.stop()
    master.stop()


def _connect(master: Server, token: str) -> kvclient.KVClient:
    return kvclient.KVClient.connect(master.grpc, NS, token=token)  # type: ignore[return-value]


async def test_a_tenant_reads_and_matches_only_its_own_kv(pool: tuple[Server, Server]) -> None:
    master, _ = pool
    tokens = prompt(1024, seed=301)
    async with await _connect(master, CLIENT) as a, await _connect(master, CLIENT_B) as b:
        assert a.block_hashes(tokens) == b.block_hashes(tokens)  # the same names
        assert await a.put_layer(tokens, 0, layer_kv(1024, 0, 301)) == 1024
        before = await a.get_layer(tokens, 0)
        assert before.shape[1] == 1024
        # Tenant B sees nothing of A's, though it names the very same blocks.
        assert await b.match_prefix(tokens) == 0
        assert (await b.get_layer(tokens, 0)).shape[1] == 0
        # B's own put of other values under those names is B's: it stores (not skipped
        # as already there) and A still reads exactly what it wrote.
        assert await b.put_layer(tokens, 0, layer_kv(1024, 0, 999)) == 1024
        assert await b.match_prefix(tokens) == 1024
        theirs = await b.get_layer(tokens, 0)
        assert not torch.equal(theirs, before)
        assert torch.equal(await a.get_layer(tokens, 0), before)
        assert await a.match_prefix(tokens) == 1024


async def test_an_abort_reaches_only_the_tenants_own_streams(
    pool: tuple[Server, Server],
) -> None:
    master, _ = pool
    tokens, other = prompt(512, seed=302), prompt(512, seed=303)
    async with (
        await _connect(master, CLIENT) as a,
        MasterClient(master.grpc, token=CLIENT) as a_master,
        MasterClient(master.grpc, token=CLIENT_B) as b_master,
    ):

        async def stream(t: list[int]) -> list[int]:
            return [layer async for layer, _ in a.stream_layers(t, timeout=20)]

        watching = asyncio.create_task(stream(tokens))
        await asyncio.sleep(0.5)  # (subscribed by now; a late one misses nothing anyway)
        await b_master.abort(NS.id, a.block_hashes(tokens), "tenant b tries")
        await asyncio.sleep(0.3)
        assert not watching.done()
        assert await a.put_layer(tokens, 0, layer_kv(512, 0, 302)) == 512
        assert await asyncio.wait_for(watching, 20) == [0]
        # The same abort by the stream's own tenant ends it: the one above was refused,
        # not lost.
        own = asyncio.create_task(stream(other))
        await asyncio.sleep(0.5)
        await a_master.abort(NS.id, a.block_hashes(other), "writer gave up")
        with pytest.raises(Miss):
            await asyncio.wait_for(own, 20)


async def test_evict_takes_only_the_named_tenants_blocks(pool: tuple[Server, Server]) -> None:
    master, node = pool
    tokens = prompt(512, seed=304)
    async with await _connect(master, CLIENT) as a, await _connect(master, CLIENT_B) as b:
        for kv, seed in ((a, 1), (b, 2)):
            assert await kv.put_layer(tokens, 0, layer_kv(512, 0, seed)) == 512
        flags = ["--model", NS.model, "--revision", NS.revision, "--layers", "1",
                 "--kv-heads", str(HEADS), "--head-dim", str(HEAD_DIM),
                 "--tokens", ",".join(map(str, tokens)), "--json"]  # fmt: skip
        run = run_kvctl(master, "evict", *flags, "--tenant", "team-b",
                        env={"KVSTORE_TOKEN": ADMIN})  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert json.loads(run.stdout)["evicted"] == 2
        assert await b.match_prefix(tokens) == 0
        assert await a.match_prefix(tokens) == 512
        # A client's ticket may not name another tenant on a data port, for a put or
        # for an eviction (which its role may not make at all).
        async with MasterClient(master.grpc, token=CLIENT_B) as mc:
            intruder = NodeClient(node.data, Dial(mc.tickets()), timeout_s=5)
            data = bytearray(b._chunk_bytes)
            chunk = PutChunk(a.block_hashes(tokens)[0], None, 0, len(data))
            with pytest.raises(PermissionDenied, match="tenant"):
                await intruder.put(NS.canonical_bytes(), [chunk], [data], tenant="team-a")
            with pytest.raises(PermissionDenied):
                await intruder.evict(NS.id, tenant="team-a")
        assert await a.match_prefix(tokens) == 512


async def test_objects_are_the_tenants_own(pool: tuple[Server, Server]) -> None:
    master, _ = pool
    async with await _connect(master, CLIENT) as a, await _connect(master, CLIENT_B) as b:
        await a.put_object("engine/config", b"tenant a's")
        assert await b.get_object("engine/config") is None
        assert not await b.exists("engine/config")
        await b.put_object("engine/config", b"tenant b's")
        assert not await b.remove("nothing/here")
        assert await a.get_object("engine/config") == b"tenant a's"
        assert await b.get_object("engine/config") == b"tenant b's"
        assert await b.remove("engine/config")
        assert await a.get_object("engine/config") == b"tenant a's"


async def test_a_tenants_event_stream_shows_its_own_namespaces(
    pool: tuple[Server, Server],
) -> None:
    master, _ = pool
    theirs, ours = prompt(512, seed=305), prompt(512, seed=306)
    async with await _connect(master, CLIENT) as a, await _connect(master, CLIENT_B) as b:
        every = b.events(all_namespaces=True, timeout=30)
        one = b.events(timeout=30)
        await anext(every), await anext(one)  # (the log ids: both streams are open)
        assert await a.put_layer(theirs, 0, layer_kv(512, 0, 1)) == 512
        assert await b.put_layer(ours, 0, layer_kv(512, 0, 2)) == 512
        wanted, unwanted = set(b.block_hashes(ours)), set(b.block_hashes(theirs))
        for stream, named in ((every, False), (one, True)):
            seen: set[bytes] = set()
            while not wanted <= seen:
                _, events = await asyncio.wait_for(anext(stream), 20)
                stored = [e for e in events if e.kind is ClusterEventKind.STORED]
                assert not {e.block_hash for e in stored} & unwanted
                seen |= {e.block_hash for e in stored}
                if named:  # its one namespace is shown under the id the client named
                    assert {e.ns_id for e in stored} <= {NS.id}
            await stream.aclose()


def test_pool_ids_differ_by_tenant_and_secret_and_name_their_tenant() -> None:
    from kvstore.core.tenancy import TenantScope

    scope, other = TenantScope("cluster-secret-0123456789"), TenantScope("another-secret-0123456")
    a, b = scope.pool_id("team-a", NS.id), scope.pool_id("team-b", NS.id)
    assert len({NS.id, a, b, other.pool_id("team-a", NS.id)}) == 4
    assert a == scope.pool_id("team-a", NS.id) and len(a) == 16
    assert scope.owns("team-a", a) and not scope.owns("team-a", b)
    assert scope.tenant_of(b) == "team-b" and scope.tenant_of(NS.id) == ""
    # (a tenant name that another's starts with, or a length prefix, is no collision)
    assert scope.pool_id("team-a", NS.id) != scope.pool_id("team-a" + "\x00", NS.id)
    key = scope.object_key("team-a", "k")
    assert key != scope.object_key("team-b", "k") and key.endswith(":k")
    # No cluster secret: no tenants, every id and key its own.
    none = TenantScope(None)
    assert none.pool_id("team-a", NS.id) == NS.id and none.object_key("team-a", "k") == "k"

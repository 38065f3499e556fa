"""Tenants the servers enforce, with real processes: a master and a node started with one
auth file that names two client tenants. Both send the same namespace and the same prompt
(so the same block hashes, whatever ``cache_salt`` says); neither can read, overwrite,
abort, evict or list the other's KV or objects, and a client that names another tenant on
a data port is refused."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvclient
from kvstore.control.client import MasterClient
from kvstore.control.records import ClusterEventKind
from kvstore.dataplane import NodeClient
from kvstore.dataplane.client import Dial
from kvstore.dataplane.messages import PutChunk
from kvstore.errors import InvalidArgument, Miss, PermissionDenied
from tests.authfile import ADMIN, CLIENT, CLIENT_B, write_auth_file
from tests.cluster import Server, run_kvctl, start_server
from tests.kvproc import HEAD_DIM, HEADS, layer_kv, namespace, prompt

pytestmark = pytest.mark.slow

NS = namespace(1)


def _pool(auth: Path, host_mem: str) -> Iterator[tuple[Server, Server]]:
    """A master (lease 3 s) and one node of ``host_mem``, both with ``auth``."""
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                          "--node-lease-s", "3", "--auth-file", str(auth))  # fmt: skip
    try:
        node = start_server("node", "--master", master.grpc, "--data-port", "0",
                            "--metrics-port", "0", "--host-mem", host_mem,
                            "--auth-file", str(auth))  # fmt: skip
    except BaseException:
        master.stop()
        raise
    yield master, node
    node.stop()
    master.stop()


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    yield from _pool(write_auth_file(tmp_path_factory.mktemp("tenants")), "64MiB")


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


async def test_a_hold_is_released_only_by_its_own_tenant(pool: tuple[Server, Server]) -> None:
    master, node = pool
    tokens = prompt(512, seed=307)
    async with (
        await _connect(master, CLIENT) as a,
        MasterClient(master.grpc, token=CLIENT) as a_master,
        MasterClient(master.grpc, token=CLIENT_B) as b_master,
    ):
        assert await a.put_layer(tokens, 0, layer_kv(512, 0, 307)) == 512
        mine = NodeClient(node.data, Dial(a_master.tickets()), timeout_s=5)
        theirs = NodeClient(node.data, Dial(b_master.tickets()), timeout_s=5)
        held = await mine.hold(NS.id, a.block_hashes(tokens), 60)
        assert held.blocks == 2
        # B names A's blocks: nothing of its own there to pin; A's hold id (hold ids are
        # easy to guess): refused as unknown, and A's pins stay.
        assert (await theirs.hold(NS.id, a.block_hashes(tokens), 60)).blocks == 0
        assert not await theirs.unhold(held.hold_id)
        assert (await mine.stats())["pinned_slots"] == 2
        assert await mine.unhold(held.hold_id)
        assert (await mine.stats())["pinned_slots"] == 0


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
        # A key the master would refuse once scoped is refused by the node, before it is
        # stored (found by review: stored, its commit then failed, with other changes).
        with pytest.raises(InvalidArgument, match="tenant's object key is at most"):
            await a.put_object("k" * 1020, b"x")
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
        for all_namespaces in (True, False):  # a snapshot passes the same filter
            snap = b.events(all_namespaces=all_namespaces, snapshot=True, timeout=30)
            got: list = []
            while not got or got[-1].kind is not ClusterEventKind.SNAPSHOT_DONE:
                got += (await asyncio.wait_for(anext(snap), 20))[1]
            await snap.aclose()
            stored = [e for e in got if e.kind is ClusterEventKind.STORED]
            assert wanted <= {e.block_hash for e in stored}
            assert not {e.block_hash for e in stored} & unwanted
            if not all_namespaces:
                assert {e.ns_id for e in stored} == {NS.id}


QUOTAS = (
    '[[tenant]]\nname = "team-a"\nquota = "8MiB"\n[[tenant]]\nname = "team-b"\nquota = "8MiB"\n'
)


@pytest.fixture
def small_pool(tmp_path: Path) -> Iterator[tuple[Server, Server]]:
    """A master whose auth file gives both tenants a quota of 8 MiB, and one node of
    24 MiB (about 46 one-layer blocks)."""
    yield from _pool(write_auth_file(tmp_path, extra=QUOTAS), "24MiB")


def _metric(server: Server, name: str, tenant: str) -> float:
    url = f"http://{server.addresses['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    line = f'{name}{{tenant="{tenant}"}} '
    values = [float(row[len(line) :]) for row in text.splitlines() if row.startswith(line)]
    assert values, f"{line!r} not in {url}"
    return values[0]


async def test_a_tenants_flood_evicts_its_own_blocks_not_another_tenants_within_quota(
    small_pool: tuple[Server, Server],
) -> None:
    master, node = small_pool
    kept = prompt(2048, seed=401)  # 8 blocks, about 4 MiB: within team-a's quota
    async with await _connect(master, CLIENT) as a, await _connect(master, CLIENT_B) as b:
        assert await a.put_layer(kept, 0, layer_kv(2048, 0, 401)) == 2048
        async with MasterClient(master.grpc, token=ADMIN) as admin:
            ops = NodeClient(node.data, Dial(admin.tickets()), timeout_s=5)
            deadline = time.monotonic() + 20
            while not any(t["quota_bytes"] for t in (await ops.stats())["tenants"]):
                assert time.monotonic() < deadline, "the node never learnt the quotas"
                await asyncio.sleep(0.2)
        # Tenant B floods the pool: 64 blocks, more than the whole node holds. Its puts
        # go on (a quota is no hard cap), but what they evict is B's own oldest blocks.
        for i in range(16):
            tokens = prompt(1024, seed=500 + i)
            assert await b.put_layer(tokens, 0, layer_kv(1024, 0, i)) == 1024
        assert await a.match_prefix(kept) == 2048
        assert (await a.get_layer(kept, 0)).shape[1] == 2048
        assert await b.match_prefix(prompt(1024, seed=500)) == 0  # B's first went
        assert await b.match_prefix(prompt(1024, seed=515)) == 1024
        # Per tenant: kvctl stats (the master, from the nodes' heartbeats) and /metrics.
        deadline = time.monotonic() + 20
        while True:
            run = run_kvctl(master, "stats", "--json", env={"KVSTORE_TOKEN": ADMIN})
            assert run.returncode == 0, run.stderr
            tenants = {t["tenant"]: t for t in json.loads(run.stdout)["tenants"]}
            if tenants.get("team-b", {}).get("evictions"):
                break
            assert time.monotonic() < deadline, tenants
            await asyncio.sleep(0.3)
        assert tenants["team-a"]["evictions"] == 0
        assert tenants["team-a"]["quota_bytes"] == tenants["team-b"]["quota_bytes"] == 8 << 20
        assert 4 << 20 <= tenants["team-a"]["used_bytes"] <= 5 << 20
        assert tenants["team-b"]["used_bytes"] > 8 << 20  # (the free memory beyond it)
        table = run_kvctl(master, "stats", env={"KVSTORE_TOKEN": ADMIN}).stdout
        assert "team-a" in table and "8.0 MiB" in table, table
        run = run_kvctl(master, "stats", "--json", env={"KVSTORE_TOKEN": CLIENT_B})
        assert [t["tenant"] for t in json.loads(run.stdout)["tenants"]] == ["team-b"]
        assert _metric(node, "kvstore_tenant_evictions_total", "team-b") > 0
        assert _metric(node, "kvstore_tenant_quota_bytes", "team-a") == 8 << 20
        assert _metric(node, "kvstore_tenant_bytes", "team-a") >= 4 << 20


async def test_a_tenant_without_a_quota_floods_its_own_blocks_out_not_a_quota_holders(
    tmp_path: Path,
) -> None:
    """Found by trying the product: with a quota for team-a only, team-b (none) flooded
    the node and evicted every block of team-a's, within its quota."""
    quota = '[[tenant]]\nname = "team-a"\nquota = "8MiB"\n'
    pool = _pool(write_auth_file(tmp_path, extra=quota), "24MiB")
    master, node = next(pool)
    try:
        kept = prompt(2048, seed=411)  # 8 blocks, about 4 MiB: within team-a's quota
        async with await _connect(master, CLIENT) as a, await _connect(master, CLIENT_B) as b:
            assert await a.put_layer(kept, 0, layer_kv(2048, 0, 411)) == 2048
            deadline = time.monotonic() + 20
            while _metric(node, "kvstore_tenant_quota_bytes", "team-a") == 0:
                assert time.monotonic() < deadline, "the node never learnt the quota"
                await asyncio.sleep(0.2)
            for i in range(16):  # more than the whole node holds
                tokens = prompt(1024, seed=600 + i)
                assert await b.put_layer(tokens, 0, layer_kv(1024, 0, i)) == 1024
            assert await a.match_prefix(kept) == 2048
            assert await b.match_prefix(prompt(1024, seed=600)) == 0  # B's own went
    finally:
        next(pool, None)  # (past its yield: stops the node and the master)


def test_pool_ids_differ_by_tenant_and_secret_and_name_their_tenant() -> None:
    from kvstore.core.tenancy import TenantScope

    scope, other = TenantScope("cluster-secret-0123456789"), TenantScope("another-secret-0123456")
    a, b = scope.pool_id("team-a", NS.id), scope.pool_id("team-b", NS.id)
    assert len({NS.id, a, b, other.pool_id("team-a", NS.id)}) == 4
    assert a == scope.pool_id("team-a", NS.id) and len(a) == 16
    assert scope.owns("team-a", a) and not scope.owns("team-a", b)
    # (a tenant name that another's starts with, or a length prefix, is no collision)
    assert scope.pool_id("team-a", NS.id) != scope.pool_id("team-a" + "\x00", NS.id)
    key = scope.object_key("team-a", "k")
    assert key != scope.object_key("team-b", "k") and key.endswith(":k")
    # No cluster secret: no tenants, every id and key its own.
    none = TenantScope(None)
    assert none.pool_id("team-a", NS.id) == NS.id and none.object_key("team-a", "k") == "k"


@pytest.mark.parametrize(
    ("tenants", "needle"),
    [
        ('[[tenant]]\nname = "team-a"\nquota = "lots"\n', "tenant 1: quota: not a size"),
        ('[[tenant]]\nname = "team-a"\n', "a table of name and quota"),
        ('[[tenant]]\nname = "a"\nquota = 1\n[[tenant]]\nname = "a"\nquota = 2\n', "listed once"),
        ('tenant = "team-a"\n', "[[tenant]] entries must be a list"),
        (
            f'[[token]]\ntoken = "{"t" * 20}"\nrole = "client"\ntenant = "{"x" * 129}"\n',
            "at most 128 characters",
        ),
        # Found by trying the product: a quota under a mistyped name left the tenant meant
        # with none, and names of spaces were taken.
        (
            f'[[token]]\ntoken = "{"t" * 20}"\nrole = "client"\ntenant = "team-a"\n'
            '[[tenant]]\nname = "team-aa"\nquota = "1GiB"\n',
            "'team-aa' has a quota but no token names that tenant",
        ),
        ('[[tenant]]\nname = "   "\nquota = 1\n', "name must be a tenant name"),
        (f'[[token]]\ntoken = "{"t" * 20}"\nrole = "client"\ntenant = "  "\n', "names its tenant"),
    ],
)
def test_a_bad_tenant_table_is_named_in_one_error(tenants: str, needle: str) -> None:
    import tomllib

    from kvstore.control.auth import AuthConfig
    from kvstore.errors import InvalidArgument

    doc = tomllib.loads(f'cluster_secret = "{"s" * 20}"\n{tenants}')
    with pytest.raises(InvalidArgument, match=re.escape(needle)):
        AuthConfig.parse(doc)
    good = tomllib.loads(f'cluster_secret = "{"s" * 20}"\n{QUOTAS}')
    assert AuthConfig.parse(good).quotas == {"team-a": 8 << 20, "team-b": 8 << 20}

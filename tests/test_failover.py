"""Reads fail over to a replica, with real processes: a master and two storage nodes as
subprocesses, every block written to both (``replicas=2``). The holder a reader would ask
first is killed (``kill -9``) or frozen (``SIGSTOP``) — the master still lists it for a
lease — and every read still returns the whole prefix, the same bytes, within its deadline:
per block, the next holder is tried once the first fails or passes its per-node deadline.
The reader tells the master, which marks the node suspect at once and lists its copies
last, so other readers go to the replica first.
A put that reaches only ``min_replicas`` of its nodes counts as stored."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator

import pytest
import torch

import kvclient
from kvstore.control.records import NodeInfo
from tests.cluster import TRANSPORTS, Server, start_server, start_servers
from tests.kvproc import layer_kv, namespace, prompt

pytestmark = pytest.mark.slow

TIMEOUT_S = 6.0


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cluster(transport: str) -> Iterator[tuple[Server, list[Server]]]:
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                          "--node-lease-s", "10")  # fmt: skip
    nodes: list[Server] = []
    try:
        args = ["--master", master.grpc, "--data-port", "0", "--metrics-port", "0",
                "--host-mem", "128MiB", "--transport", transport]  # fmt: skip
        nodes += start_servers(("node", *args), ("node", *args))
        yield master, nodes
    finally:
        for node in nodes:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)
            node.stop()
        master.stop()


async def _connect(master: Server, wait: bool = True, **options: object) -> kvclient.KVClient:
    options = {"replicas": 2, "timeout_s": TIMEOUT_S, **options}
    kv = await kvclient.KVClient.connect(master.grpc, namespace(2), **options)
    deadline = time.monotonic() + 10
    while wait and len(await kv._live_nodes(refresh=True)) < 2:  # (both placeable)
        assert time.monotonic() < deadline, "the two nodes did not register"
        await asyncio.sleep(0.1)
    return kv


async def _info(kv: kvclient.KVClient, node: Server) -> NodeInfo:
    infos = {i.node_id: i for i in await kv._master.nodes()}
    return infos[node.addresses["node"]]


def _first_holder(nodes: list[Server]) -> Server:
    """The node a reader asks first (the master lists holders by node id)."""
    return min(nodes, key=lambda n: n.addresses["node"])


@pytest.mark.parametrize("fault", ["kill", "freeze"])
async def test_a_dead_or_frozen_holder_costs_no_tokens(
    cluster: tuple[Server, list[Server]], transport: str, fault: str
) -> None:
    master, nodes = cluster
    tokens = prompt(2048, seed=91)
    async with await _connect(master) as kv:
        for layer in range(2):
            assert await kv.put_layer(tokens, layer, layer_kv(2048, layer, 91)) == 2048
        ref = [(await kv.get_layer(tokens, layer)).clone() for layer in range(2)]
        victim = _first_holder(nodes)
        victim.proc.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        for layer in range(2):  # the master still lists the victim first
            assert torch.equal(await kv.get_layer(tokens, layer), ref[layer])
        streamed = [t async for _, t in kv.stream_layers(tokens, timeout=TIMEOUT_S)]
        assert all(torch.equal(t, r) for t, r in zip(streamed, ref, strict=True))
        assert await kv.match_prefix(tokens) == 2048
        # A hold on the victim costs node_timeout_s at most, not the call's whole deadline
        # (the connector matches with a hold: a frozen node stalled every request).
        assert await kv.match_prefix(tokens, hold_s=5) == 2048
        began = time.monotonic()  # a node that failed a hold is not asked again at once
        assert await kv.match_prefix(tokens, hold_s=5) == 2048
        assert time.monotonic() - began < kv.node_timeout_s
        if not kv._reads.stats.failed_reads:
            # Nothing failed: a stopped process's memory is still READable over ucx://.
            assert fault == "freeze" and transport == "ucx"
            return
        deadline = time.monotonic() + 3  # the reader told the master, in the background
        while not (info := await _info(kv, victim)).suspect:
            assert time.monotonic() < deadline, info
            await asyncio.sleep(0.05)
        assert info.alive  # suspect at once, long before its lease (10 s) runs out
    async with await _connect(master, wait=False) as fresh:  # knows nothing of the failure
        for layer in range(2):
            assert torch.equal(await fresh.get_layer(tokens, layer), ref[layer])
        assert fresh._reads.stats.failed_reads == 0  # the master listed the victim last


async def test_a_put_counts_as_stored_on_min_replicas(
    cluster: tuple[Server, list[Server]],
) -> None:
    master, nodes = cluster
    async with (
        await _connect(master) as both,
        await _connect(master, min_replicas=1) as either,
    ):
        _first_holder(nodes).proc.send_signal(signal.SIGKILL)  # still listed: placed on
        tokens = prompt(1024, seed=92)
        with pytest.raises(kvclient.errors.KVStoreError):  # needs both: none is stored
            await both.put_layer(tokens, 0, layer_kv(1024, 0, 92))
        assert await either.put_layer(tokens, 0, layer_kv(1024, 0, 92)) == 1024
        assert (await either.get_layer(tokens, 0)).shape[1] == 1024


async def test_a_frozen_replica_does_not_fail_a_put_stored_elsewhere(
    cluster: tuple[Server, list[Server]],
) -> None:
    """``min_replicas=1``: a put whose other replica is frozen (SIGSTOP, still listed)
    counts the copy that landed; the frozen one gets one per-node deadline more and is
    given up, instead of the whole put timing out (as the chaos harness first found)."""
    master, nodes = cluster
    async with await _connect(master, min_replicas=1) as either:
        victim = _first_holder(nodes)
        victim.proc.send_signal(signal.SIGSTOP)
        try:
            tokens = prompt(1024, seed=94)
            assert await either.put_layer(tokens, 0, layer_kv(1024, 0, 94)) == 1024
            got = await either.get_layer(tokens, 0)
            assert got.shape[1] == 1024
        finally:
            victim.proc.send_signal(signal.SIGCONT)


async def test_a_node_stopped_with_sigterm_leaves_at_once(
    cluster: tuple[Server, list[Server]],
) -> None:
    """SIGTERM: the node deregisters as it stops, so the master drops its entries at once
    (not a lease later) and readers go straight to the replica."""
    master, nodes = cluster
    tokens = prompt(1024, seed=93)
    async with await _connect(master) as kv:
        assert await kv.put_layer(tokens, 0, layer_kv(1024, 0, 93)) == 1024
        victim = _first_holder(nodes)
        rc, out = victim.stop()
        assert rc == 0, out
        info = await _info(kv, victim)
        assert not info.alive  # at once: the lease (10 s) has not run out
        holders = await kv._master.lookup(kv.ns.id, kv.block_hashes(tokens), 2)
        assert all(h.node_id != victim.addresses["node"] for block in holders for h in block)
        assert all(len(block) == 1 for block in holders)
        assert (await kv.get_layer(tokens, 0)).shape[1] == 1024
        assert kv._reads.stats.failed_reads == 0


async def test_a_put_with_every_node_draining_says_so(
    cluster: tuple[Server, list[Server]],
) -> None:
    master, nodes = cluster
    async with await _connect(master) as kv:
        for node in nodes:
            assert await kv._master.drain(node.addresses["node"])
        await kv._live_nodes(refresh=True)  # (the client reuses its node list for 1 s)
        with pytest.raises(kvclient.errors.Unreachable, match="2 draining"):
            await kv.put_layer(prompt(256, seed=94), 0, layer_kv(256, 0, 94))


async def _refreshed_behind(kv: kvclient.KVClient, master: Server, age: float) -> None:
    """With ``kv``'s node list ``age`` seconds old and the master frozen, a call answers at
    once with the list and refreshes it in the background; the refresh lands once the
    master answers again."""
    kv._nodes_at = before = time.monotonic() - age
    master.proc.send_signal(signal.SIGSTOP)
    try:
        assert len(await asyncio.wait_for(kv._live_nodes(), 2.0)) == 2
        assert kv._nodes_ahead is not None and kv._nodes_at == before  # (behind)
    finally:
        master.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + TIMEOUT_S
    while kv._nodes_ahead is not None:
        assert time.monotonic() < deadline, "the refresh never landed"
        await asyncio.sleep(0.05)
    assert kv._nodes_at > before and len(kv._nodes) == 2


@pytest.mark.parametrize("transport", ["tcp"])  # (the node list is the same for either)
async def test_a_node_list_past_half_its_life_is_refreshed_behind_the_calls(
    cluster: tuple[Server, list[Server]],
) -> None:
    """A client places puts on a snapshot of the node list. Past half its life the call
    that finds it so goes on with it and refreshes it in the background, so steady puts
    never wait for the master's ``Nodes`` RPC (here the master is frozen meanwhile: the
    call still answers at once); the refresh lands once the master answers again."""
    from kvclient.client import _NODES_TTL_S

    master, _ = cluster
    async with await _connect(master) as kv:
        await _refreshed_behind(kv, master, 0.75 * _NODES_TTL_S)


@pytest.mark.parametrize("transport", ["tcp"])  # (the node list is the same for either)
async def test_a_node_list_past_its_life_serves_calls_while_trusted(
    cluster: tuple[Server, list[Server]],
) -> None:
    """The first put after a quiet spell (an engine's requests seconds apart) finds the
    snapshot past its life. While it is trusted and younger than ``_NODES_STALE_S``, calls
    go on with it while a refresh runs behind them (the master is frozen meanwhile: the
    call still answers at once). Once a node fails one of this client's puts, a snapshot
    past its life is not used again: the next call waits for the master's new list."""
    from kvclient.client import _NODES_STALE_S, _NODES_TTL_S

    master, nodes = cluster
    quiet = (_NODES_TTL_S + _NODES_STALE_S) / 2
    async with await _connect(master, min_replicas=1) as kv:
        await _refreshed_behind(kv, master, quiet)

        nodes[0].proc.kill()  # (the master lists it for its lease: the put still goes there)
        nodes[0].proc.wait(timeout=10)
        tokens = prompt(512, seed=95)
        await kv.put_layer(tokens, 0, layer_kv(512, 0, 95))  # (stored on the other node)
        assert not kv._nodes_trusted
        kv._nodes_at = before = time.monotonic() - quiet
        await kv._live_nodes()
        assert kv._nodes_at > before and kv._nodes_ahead is None  # (asked, on the call's path)
        assert kv._nodes_trusted


async def test_a_put_whose_commit_the_master_cannot_take_is_answered_so(
    cluster: tuple[Server, list[Server]],
) -> None:
    """The master killed: a node that received a put but cannot commit it answers a typed
    error that names the master (the chunks are not known stored), on a connection that
    stays usable, and the client does not hold that against the node. It dropped the
    connection instead (the client saw the node disconnect)."""
    master, nodes = cluster
    async with await _connect(master) as kv:
        assert await kv.put_layer(prompt(512, seed=95), 0, layer_kv(512, 0, 95)) == 512
        blamed: list[None] = []
        kv._writes._node_failed = lambda: blamed.append(None)  # (what a node failing calls)
        master.kill()
        for seed in (96, 97):  # (the second: on the connections the first used)
            # The node list the first put used, still fresh: the put goes to the node, not
            # to the dead master for a new list (a loaded machine can take the node's own
            # wait for its master past the list's life; CI's did).
            kv._nodes_at = time.monotonic()
            with pytest.raises(kvclient.errors.MasterUnreachable, match="not known stored"):
                await kv.put_layer(prompt(512, seed=seed), 0, layer_kv(512, 0, seed))
        assert blamed == []  # (the node was not at fault)
        assert all(n.proc.poll() is None for n in nodes)


async def test_a_node_that_failed_a_put_takes_no_new_blocks_from_that_client(
    cluster: tuple[Server, list[Server]],
) -> None:
    """A node killed (``kill -9``; the master lists it until its lease ends): the put that
    finds it dead loses the blocks placed there, and the client's next puts place every
    block on the nodes left. They kept going to it for half a lease."""
    master, nodes = cluster
    async with await _connect(master, replicas=1) as kv:
        first, second = prompt(1024, seed=98), prompt(1024, seed=99)
        placed = kv._place(kv.block_hashes(first)[0], await kv._live_nodes())[0]
        victim = next(n for n in nodes if n.addresses["node"] == placed.node_id)
        victim.kill()
        with contextlib.suppress(kvclient.errors.KVStoreError):  # (raises if none stored)
            assert await kv.put_layer(first, 0, layer_kv(1024, 0, 98)) == 0
        for tokens, seed in ((second, 99), (first, 98)):
            assert await kv.put_layer(tokens, 0, layer_kv(1024, 0, seed)) == 1024
            assert (await kv.get_layer(tokens, 0)).shape[1] == 1024


async def test_an_objects_last_writer_wins_when_a_node_joins() -> None:
    """Objects put while one node serves, put again with other values by a fresh client once
    a second node has joined (placement moves many keys to the empty node), read back as
    the newer values: the put removes the older copy it did not overwrite, and a read
    never takes an older version than the newest listed."""
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0")
    args = ("node", "--master", master.grpc, "--data-port", "0", "--metrics-port", "0",
            "--host-mem", "64MiB")  # fmt: skip
    nodes = [start_server(*args, "--node-id", "node-a")]  # (listed first: ids sort)
    keys = [f"key-{i}" for i in range(20)]
    try:
        async with await _connect(master, wait=False, replicas=1) as kv:
            for k in keys:
                await kv.put_object(k, b"v1-" + k.encode())
        nodes.append(start_server(*args, "--node-id", "node-b"))
        async with await _connect(master, replicas=1) as kv:  # (waits for both nodes)
            for k in keys:
                await kv.put_object(k, b"v2-" + k.encode())
            assert [await kv.get_object(k) for k in keys] == [b"v2-" + k.encode() for k in keys]
            holders = [await kv._master.lookup_object(k) for k in keys]
            second = nodes[1].addresses["node"]
            assert any(h.node_id == second for hs in holders for h in hs)  # (keys moved)
            assert all(len(hs) == 1 for hs in holders)  # the older copies were removed
    finally:
        for node in nodes:
            node.stop()
        master.stop()

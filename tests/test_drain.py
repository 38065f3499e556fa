"""Drain with migration, with real processes: a master and three storage nodes as
subprocesses, prompts written with ``replicas=1`` and ``replicas=2``. ``kvctl drain NODE
--wait`` returns once the node has copied every block it held to the nodes placement
chooses next (node to node, checked on arrival); after the node is stopped every prompt is
still readable, bit for bit, and a block written twice still has two copies (blocks whose
layers sit on two nodes too). A node started with ``--drain-on-exit`` does the same by
itself on SIGTERM. Draining the only node waits, and says why, instead of reporting
success. A prompt's later layers go to the nodes its first went to, even when the client's
node list weighs the nodes anew between them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

import kvclient
from kvclient.reads import NodeEntry
from tests.cluster import Server, run_kvctl, start_server, start_servers
from tests.kvproc import layer_kv, namespace, prompt

pytestmark = pytest.mark.slow

LAYERS = 2


def _node_args(master: Server, transport: str, *extra: str) -> list[str]:
    return ["node", "--master", master.grpc, "--data-port", "0", "--metrics-port", "0",
            "--host-mem", "64MiB", "--transport", transport, *extra]  # fmt: skip


@pytest.fixture
def master() -> Iterator[Server]:
    # A 3 s lease: heartbeats (which carry the draining mark to the node) every second.
    srv = start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                       "--node-lease-s", "3")  # fmt: skip
    yield srv
    srv.stop()


async def _connect(master: Server, nodes: int, replicas: int) -> kvclient.KVClient:
    kv = await kvclient.KVClient.connect(
        master.grpc, namespace(LAYERS), replicas=replicas, timeout_s=10
    )
    deadline = time.monotonic() + 20
    while len(await kv._live_nodes(refresh=True)) < nodes:
        assert time.monotonic() < deadline, "the nodes did not register"
        await asyncio.sleep(0.1)
    return kv


async def _write(
    kv: kvclient.KVClient, seed: int, split: bool = False
) -> tuple[list[int], list[torch.Tensor]]:
    """A prompt of ``LAYERS`` layers; ``split``: its blocks' layers on different nodes, as
    when the client's node list is refreshed between two layers while a node that holds
    layer 0 is briefly not placeable (here: the one with most of layer 0)."""
    tokens = prompt(2048, seed=seed)
    for layer in range(LAYERS):
        if split and layer == 1:
            busiest = await _busiest(kv, tokens)
            _new_snapshot(kv, [n for n in kv._nodes if n is not busiest])
        assert await kv.put_layer(tokens, layer, layer_kv(2048, layer, seed)) == 2048
    return tokens, [(await kv.get_layer(tokens, layer)).clone() for layer in range(LAYERS)]


async def _holders(kv: kvclient.KVClient, tokens: list[int]) -> list[dict[str, int]]:
    """Per block: holder node id -> its chunk mask."""
    found = await kv._master.lookup(kv.ns.id, kv.block_hashes(tokens))
    return [{h.node_id: h.mask for h in block} for block in found]


async def _busiest(kv: kvclient.KVClient, tokens: list[int]) -> NodeEntry:
    """The node of the client's snapshot that holds most of ``tokens``' blocks."""
    held = await _holders(kv, tokens)
    return max(kv._nodes, key=lambda n: sum(n.node_id in block for block in held))


def _new_snapshot(kv: kvclient.KVClient, nodes: list[NodeEntry]) -> None:
    """Make ``nodes`` the client's node list, as a refresh would (fresh now)."""
    kv._nodes, kv._nodes_at = nodes, time.monotonic()


async def test_a_prompts_later_layers_go_where_its_first_went(master: Server) -> None:
    """A node list refreshed between two layers of a prompt may weigh the nodes anew
    (heartbeats moved a node's free bytes across a power of two): the prompt's later
    layers still go to the nodes its first went to, so each block sits whole on one
    holder (a node no longer placeable is left: the drain test's ``split``)."""
    nodes = start_servers(*[_node_args(master, "tcp") for _ in range(3)])
    try:
        async with await _connect(master, 3, replicas=1) as kv:
            tokens = prompt(2048, seed=104)
            assert await kv.put_layer(tokens, 0, layer_kv(2048, 0, 104)) == 2048
            busiest = await _busiest(kv, tokens)
            # Its weight falls to the least (free bytes 1): HRW alone would move its blocks.
            _new_snapshot(kv, [replace(n, free_bytes=1) if n is busiest else n
                               for n in kv._nodes])  # fmt: skip
            assert await kv.put_layer(tokens, 1, layer_kv(2048, 1, 104)) == 2048
            held = await _holders(kv, tokens)
            assert any(busiest.node_id in block for block in held)
            assert all(list(block.values()) == [(1 << LAYERS) - 1] for block in held), held
    finally:
        for node in nodes:
            node.stop()


def _copies(block: dict[str, int], without: str = "") -> list[int]:
    """Per layer: how many nodes (other than ``without``) hold that layer's chunk."""
    return [sum(bool(m >> layer & 1) for n, m in block.items() if n != without)
            for layer in range(LAYERS)]  # fmt: skip


async def test_drain_wait_then_stop_loses_no_block(master: Server) -> None:
    # (tcp:// writers only: the copy is node to node over tcp:// whatever the writers used;
    # a draining node's refusal to grant ucx:// slots is tests/test_migrate.py's)
    nodes = start_servers(*[_node_args(master, "tcp") for _ in range(3)])
    try:
        async with (
            await _connect(master, 3, replicas=1) as one,
            await _connect(master, 3, replicas=2) as two,
        ):
            single, single_ref = await _write(one, seed=101, split=True)
            double, double_ref = await _write(two, seed=102, split=True)
            held_once, held_twice = await _holders(one, single), await _holders(two, double)
            before = held_once + held_twice
            # Some blocks' layers sit on different nodes (``split``), which placement allows
            # (docs/decisions.md, "Placement weights are quantised..."): presence is per
            # chunk, so the checks count chunks (mask bits), not whole blocks.
            wanted = [1] * len(held_once) + [2] * len(held_twice)
            assert any(len(block) > copies for block, copies in zip(before, wanted, strict=True))
            for block, copies in zip(before, wanted, strict=True):
                assert _copies(block) == [copies] * LAYERS, block
            # The node holding the most chunks leaves.
            count = {n.addresses["node"]: 0 for n in nodes}
            for block in before:
                for node_id, mask in block.items():
                    count[node_id] += mask.bit_count()
            victim = max(nodes, key=lambda n: count[n.addresses["node"]])
            vid = victim.addresses["node"]
            assert count[vid] > 0

            run = run_kvctl(master, "drain", vid, "--wait", "--wait-s", "60", "--json", timeout=120)
            assert run.returncode == 0, run.stderr
            report = json.loads(run.stdout)
            assert report["node"] == vid and report["draining"] is True
            # Every chunk it held had to be copied: none had a copy on a node that stays
            # beyond the ones counted (replicas=2 keeps two copies).
            assert report["drain_moved_chunks"] == count[vid], report
            assert report["drain_failed"] == 0 and report["drain_dropped"] == 0

            after = await _holders(one, single) + await _holders(two, double)
            for block, copies in zip(after, wanted, strict=True):
                assert _copies(block, without=vid) == [copies] * LAYERS, block

            rc, out = victim.stop()
            assert rc == 0, out
        async with (
            await _connect(master, 2, replicas=1) as fresh,
            await _connect(master, 2, replicas=2) as fresh2,
        ):
            for kv, tokens, ref in ((fresh, single, single_ref), (fresh2, double, double_ref)):
                assert await kv.match_prefix(tokens) == 2048
                for layer in range(LAYERS):
                    assert torch.equal(await kv.get_layer(tokens, layer), ref[layer])
            assert fresh._reads.stats.failed_reads == 0
    finally:
        for node in nodes:
            node.stop()


async def test_drain_on_exit_copies_before_leaving(master: Server) -> None:
    nodes = start_servers(*[_node_args(master, "tcp", "--drain-on-exit", "60") for _ in range(2)])
    try:
        async with await _connect(master, 2, replicas=1) as kv:
            tokens, ref = await _write(kv, seed=103)
            held = await _holders(kv, tokens)
            victim = max(nodes, key=lambda n: sum(n.addresses["node"] in block for block in held))
            rc, out = victim.stop(timeout=90)
            assert rc == 0, out
            assert "kvstore drained state=done" in out and "left=0 failed=0" in out, out
            vid = victim.addresses["node"]
            infos = {i.node_id: i for i in await kv._master.nodes()}
            assert not infos[vid].alive  # deregistered as it left
            for block in await _holders(kv, tokens):
                assert set(block) - {vid} and vid not in block
            for layer in range(LAYERS):
                assert torch.equal(await kv.get_layer(tokens, layer), ref[layer])
    finally:
        for node in nodes:
            node.stop()


async def test_draining_the_only_node_waits_and_says_why(master: Server) -> None:
    node = start_server(*_node_args(master, "tcp"))
    try:
        async with await _connect(master, 1, replicas=1) as kv:
            tokens, ref = await _write(kv, seed=104)
            run = run_kvctl(master, "drain", node.addresses["node"], "--wait", "--wait-s", "3")
            assert run.returncode == 1
            assert "not done within 3 s" in run.stderr and "draining" in run.stderr, run.stderr
            # Nothing was lost meanwhile: the node still serves what it holds.
            for layer in range(LAYERS):
                assert torch.equal(await kv.get_layer(tokens, layer), ref[layer])
            # (a quiet client goes on with its node list for up to 5 s while it refreshes
            # it: the put that finds the draining mark is one on a list fetched since)
            await kv._live_nodes(refresh=True)
            with pytest.raises(kvclient.errors.Unreachable, match="draining"):
                await kv.put_layer(prompt(512, seed=105), 0, layer_kv(512, 0, 105))
            undrain = run_kvctl(master, "drain", node.addresses["node"], "--undrain")
            assert undrain.returncode == 0, undrain.stderr
    finally:
        node.stop()

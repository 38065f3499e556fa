"""The node's master link on its own (``kvstore.node.master_link``), against a real master
over loopback gRPC: registration re-reports every landed slot; heartbeats carry the
master's draining mark back to the node (set and cleared), the first as heartbeats start;
a heartbeat whose master is down moves on to the next address; a commit answered "stale
epoch" asks for a new registration; evictions whose commit failed go with the next one."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
import redis

from kvstore.control.client import MasterClient
from kvstore.core.slots import ObjectStore
from kvstore.errors import KVStoreError, TransportError, Unreachable
from kvstore.master import BlockAdd, MasterConfig, MasterServer
from kvstore.metrics import Metrics
from kvstore.node.master_link import MasterLink, NodeIdentity
from kvstore.node.tiers import Tiers
from tests.cluster import start_server

T = TypeVar("T")

LEASE_S = 0.9
"""Heartbeats every 0.3 s."""
ME = NodeIdentity("link-node", "tcp://127.0.0.1:1", "tcp", b"", "127.0.0.1")


@pytest.fixture
async def master() -> AsyncIterator[MasterServer]:
    srv = MasterServer(MasterConfig(grpc_port=0, node_lease_s=LEASE_S))
    await srv.start()
    yield srv
    await srv.stop(grace=0.5)


def _link(address: str) -> MasterLink:
    tiers = Tiers(4 * 2**20)
    objects = ObjectStore(tiers.host.arena, make_room=tiers.host.table.evict_lru)
    return MasterLink(MasterClient(address), address, tiers, objects, Metrics())


async def _until(check: object, what: str, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():  # type: ignore[operator]
            await asyncio.sleep(0.02)


async def test_heartbeats_carry_the_draining_mark(master: MasterServer) -> None:
    link = _link(master.address)
    marks: list[bool] = []
    link.on_draining = marks.append
    admin = MasterClient(master.address)
    try:
        await link.register(ME)
        link.start_heartbeats(ME.node_id, asyncio.get_running_loop())
        await _until(lambda: marks, "a heartbeat answer")
        assert marks[-1] is False
        assert await admin.drain(ME.node_id) is True
        await _until(lambda: marks[-1] is True, "the mark set")
        assert await admin.drain(ME.node_id, undrain=True) is False
        await _until(lambda: marks[-1] is False, "the mark cleared")
        info = {n.node_id: n for n in await admin.nodes()}[ME.node_id]
        assert info.alive and not info.suspect  # heartbeats kept the lease
    finally:
        await admin.close()
        await link.close()


async def test_the_first_heartbeat_goes_as_heartbeats_start() -> None:
    """A node registers, then starts heartbeats: the first goes at once, not a period
    later, so a node kept busy by its start (a slow first channel on top of a period) is
    not suspect for it. Here a period is 10 s (a 30 s lease) and the answer comes within
    3."""
    srv = MasterServer(MasterConfig(grpc_port=0, node_lease_s=30.0))
    await srv.start()
    link = _link(srv.address)
    marks: list[bool] = []
    link.on_draining = marks.append
    try:
        await link.register(ME)
        link.start_heartbeats(ME.node_id, asyncio.get_running_loop())
        await _until(lambda: marks, "the first heartbeat's answer", timeout=3.0)
    finally:
        await link.close()
        await srv.stop(grace=0.5)


async def test_a_heartbeat_moves_on_from_a_dead_master(master: MasterServer) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    link = _link(f"{dead},{master.address}")
    marks: list[bool] = []
    link.on_draining = marks.append
    admin = MasterClient(master.address)
    try:
        await link.register(ME)  # (the unary client fails over too)
        link.start_heartbeats(ME.node_id, asyncio.get_running_loop())
        await asyncio.sleep(3 * LEASE_S)  # three leases: dead without heartbeats
        info = {n.node_id: n for n in await admin.nodes()}[ME.node_id]
        assert info.alive and info.epoch == link.epoch
        assert len(marks) >= 3  # answers came from the live master
    finally:
        await admin.close()
        await link.close()


async def test_registration_re_reports_and_a_stale_commit_asks_again(
    master: MasterServer,
) -> None:
    link = _link(master.address)
    admin = MasterClient(master.address)
    try:
        tiers = link.tiers
        slot = tiers.host.table.allocate((b"n" * 16, b"b" * 16), 64, 64, 1).slot
        tiers.host.table.mark_landed(slot, 0)
        await link.register(ME)
        [held] = await admin.lookup(b"n" * 16, [b"b" * 16])
        assert [h.node_id for h in held] == [ME.node_id]
        # A new registration with this process's key (what the sweeper does after a lost
        # lease; another key is refused while this one lives): the link's epoch is dead.
        admin.session = link.master.session
        await admin.register(ME.node_id, "tcp://127.0.0.1:2")
        with pytest.raises(TransportError, match="re-registering"):
            await link.commit([BlockAdd(b"n" * 16, b"c" * 16, (0,))])
        assert link.reregister.is_set()
        old = link.epoch
        await link.register(ME)
        assert link.epoch > old
        [held] = await admin.lookup(b"n" * 16, [b"b" * 16])
        assert [(h.node_id, h.epoch) for h in held] == [(ME.node_id, link.epoch)]
    finally:
        await admin.close()
        await link.close()


@pytest.mark.skipif(not os.environ.get("KVSTORE_TEST_REDIS"), reason="KVSTORE_TEST_REDIS unset")
async def test_an_eviction_whose_commit_failed_goes_with_the_next(tmp_path: Path) -> None:
    """The master goes away (kill -9) between a node's eviction and its commit, and comes
    back on its port over the same Redis, where the node's epoch is still alive: the
    eviction reaches it with the next commit. It was dropped with the failed batch, and
    the master listed the evicted block on this node for as long as the node lived."""
    url = os.environ["KVSTORE_TEST_REDIS"].rsplit("/", 1)[0] + "/13"
    with redis.Redis.from_url(url, socket_timeout=5) as r:
        r.flushdb()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ("master", "--grpc-port", str(port), "--metrics-port", "0", "--redis", url,
            "--node-lease-s", "30")  # fmt: skip
    first = start_server(*argv)
    link = _link(f"127.0.0.1:{port}")
    key = (b"e" * 16, b"v" * 16)
    try:
        tiers = link.tiers
        slot = tiers.host.table.allocate(key, 64, 64, 1).slot
        tiers.host.table.mark_landed(slot, 0)
        await link.register(ME)
        [held] = await link.master.lookup(key[0], [key[1]])
        assert [h.node_id for h in held] == [ME.node_id]
        first.proc.kill()
        first.proc.wait(10)
        assert tiers.host.table.evict(key)
        tiers.evicted(tiers.host, [key])
        with pytest.raises(KVStoreError):
            await link.commit([])
        second = start_server(*argv)
        admin = MasterClient(second.grpc)
        try:
            await _retried(lambda: link.commit([]))  # as the node's sweeper commits again
            [held] = await _retried(lambda: admin.lookup(key[0], [key[1]]))
            assert held == [], "the master still lists the evicted block"
        finally:
            await admin.close()
            second.stop()
    finally:
        if first.proc.poll() is None:
            first.stop()
        await link.close()


async def _retried(call: Callable[[], Awaitable[T]], timeout: float = 15.0) -> T:
    """``call()`` until it does not raise Unreachable (a restarted master's port, the
    channel's reconnect backoff), bounded by ``timeout``."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                return await call()
            except Unreachable:
                await asyncio.sleep(0.2)

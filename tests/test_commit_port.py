"""The master's commit port (``kvstore/control/commit_port.py``) over real sockets: a
node's commits go there instead of gRPC, with the same verdicts; deadlines, cancellation,
restarts and failover leave each commit its own answer; garbage, unauthenticated and
wrong-role connections are answered or closed and apply nothing; TLS; a port out of reach
costs one dial per backoff window."""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.control import client as client_module
from kvstore.control import commit_port as commit_port_module
from kvstore.control import wire
from kvstore.control.auth import AuthConfig
from kvstore.control.tls import TlsFiles, server_credentials
from kvstore.dataplane.handshake import TicketSource, dial
from kvstore.errors import (
    CapacityError,
    Closed,
    InvalidArgument,
    PermissionDenied,
    TransportError,
    Unauthorized,
    Unreachable,
)
from kvstore.master import (
    CommitBatch,
    MasterClient,
    MasterConfig,
    MasterServer,
    MemoryIndexStore,
    StaleEpoch,
)
from kvstore.transport import connect
from kvstore.transport.base import Connection
from tests.authfile import SECRET, write_auth_file
from tests.certs import make_ca, make_signed
from tests.test_master import (
    CPB,
    NS,
    FakeClock,
    bh,
    commit,
    register,
    running,
    stall_apply,
    two_masters,
)

SHORT_BACKOFF = (0.3, 0.3)
"""The client's commit-port backoff in the tests that wait it out (30 s in production)."""


def batch_bytes(batch: CommitBatch, session: bytes = b"") -> bytes:
    """``batch`` as a commit frame's buffer: a serialized CommitRequest."""
    req = wire.commit_to_pb(batch)
    req.session = session
    return req.SerializeToString()


def uri_of(server: MasterServer) -> str:
    assert server.commits is not None
    return f"tcp://127.0.0.1:{server.commits.port}"


async def exchange(conn: Connection, header: dict[str, Any], *buffers: bytes) -> dict[str, Any]:
    """Send one frame and return the answer's header."""
    await conn.send(header, list(buffers), timeout=2)
    return (await conn.recv_header(timeout=5)).header


async def assert_closed(conn: Connection) -> None:
    """The master closed ``conn`` (not merely silent: a timeout would be KVTimeout)."""
    with pytest.raises((TransportError, Closed)):
        await conn.recv_header(timeout=5)


async def holders(client: MasterClient, blocks: range) -> list[list[str]]:
    """Each block's holders' node ids, in the master's index."""
    found = await client.lookup(NS, [bh(i) for i in blocks], CPB)
    return [[h.node_id for h in hs] for hs in found]


@pytest.fixture
def short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed commit port is left alone 0.3 s, not 30 s (clients made after this)."""
    monkeypatch.setattr(client_module, "_LINK_BACKOFF_S", SHORT_BACKOFF)


# -- commits and verdicts ------------------------------------------------------------------------


async def test_commits_go_on_the_commit_port_with_commits_verdicts() -> None:
    async with running() as (server, client):
        counters = server.service.counters
        assert server.commits is not None and server.service.commit_port == server.commits.port
        epoch = await register(client, "a")
        for seq in range(1, 6):
            assert await client.commit(commit("a", epoch, seq, (seq, (0,)))) == seq
        assert (counters.commit_links, counters.commit_streams, counters.commits) == (1, 0, 5)
        assert server.service.rpc_calls["Commit"] == 5  # (timed as Commit)
        with pytest.raises(StaleEpoch):
            await client.commit(commit("a", epoch + 7, 6, (6, (0,))))
        with pytest.raises(InvalidArgument):
            await client.commit(commit("a", epoch, 0, (6, (0,))))
        assert await client.commit(commit("a", epoch, 6, (6, (1,)))) == 6
        assert (counters.commit_links, counters.commit_streams, counters.commits) == (1, 0, 6)
        assert await holders(client, range(1, 8)) == [["a"]] * 6 + [[]]
        ((holder,),) = await client.lookup(NS, [bh(6)], CPB)
        assert holder.chunks() == [1] and holder.epoch == epoch


async def test_a_commit_under_another_registration_key_is_refused() -> None:
    async with running() as (server, owner):
        owner.session = b"\x11" * 32
        epoch = await register(owner, "a")
        assert await owner.commit(commit("a", epoch, 1, (1, (0,)))) == 1
        intruder = MasterClient(server.address, timeout_s=5)
        try:
            intruder.session = b"\x22" * 32
            await register(intruder, "b")  # (learns the commit port)
            with pytest.raises(PermissionDenied):
                await intruder.commit(commit("a", epoch, 2, (9, (0,))))
            counters = server.service.counters
            assert (counters.commit_links, counters.commit_streams, counters.commits) == (2, 0, 1)
            assert await holders(owner, range(1, 10)) == [["a"]] + [[]] * 8
            assert await owner.commit(commit("a", epoch, 2, (2, (0,)))) == 2
        finally:
            await intruder.close()


async def test_a_batch_over_the_message_bound_gets_grpcs_verdict_and_the_port_stays() -> None:
    """A batch larger than a gRPC message may be is refused as gRPC refuses it (nothing sent)
    without going to the port, which would close on it unanswered: no second dial, and the
    port is not left alone for the commits after it."""
    limit = 1 << 20
    async with running(MasterConfig(grpc_port=0, max_message_bytes=limit)) as (server, _):
        counters = server.service.counters
        client = MasterClient(server.address, timeout_s=5, max_message_bytes=limit)
        try:
            epoch = await register(client, "a")
            big = commit("a", epoch, 1, *((i, (0,)) for i in range(1, 30000)))
            assert wire.commit_to_pb(big).ByteSize() > limit
            with pytest.raises(CapacityError):
                await client.commit(big)
            assert (counters.commit_links, counters.commits) == (0, 0)
            # The port takes the next one (a port left alone would leave it to gRPC).
            assert await client.commit(commit("a", epoch, 1, (1, (0,)))) == 1
            assert (counters.commit_links, counters.commits) == (1, 1)
            assert await holders(client, range(1, 3)) == [["a"], []]
        finally:
            await client.close()


# -- restarts, failover, stop --------------------------------------------------------------------


async def test_a_master_restarted_with_a_new_commit_port_gets_the_commits() -> None:
    """The old port is gone: that commit falls back to gRPC, whose answer names the new
    port, and the next one goes to the new port at once (the backoff was the old
    port's)."""
    store, clock = MemoryIndexStore(), FakeClock()
    first = MasterServer(MasterConfig(grpc_port=0), store, clock=clock)
    await first.start()
    client = MasterClient(first.address, timeout_s=5)
    try:
        epoch = await register(client, "a")
        assert await client.commit(commit("a", epoch, 1, (1, (0,)))) == 1
        assert first.service.counters.commit_links == 1
        await first.stop(grace=0.1)
        second = MasterServer(MasterConfig(grpc_port=first.port), store, clock=clock)
        await second.start()
        try:
            assert second.commits is not None and first.commits is not None
            assert second.commits.port != first.commits.port
            assert await client.commit(commit("a", epoch, 2, (2, (0,)))) == 2
            counters = second.service.counters
            assert (counters.commit_links, counters.commit_streams) == (0, 1)
            for seq in (3, 4, 5):
                assert await client.commit(commit("a", epoch, seq, (seq, (0,)))) == seq
            assert (counters.commit_links, counters.commit_streams) == (1, 1)
            assert counters.commits == 4
            assert await holders(client, range(1, 6)) == [["a"]] * 5
        finally:
            await second.stop(grace=0.1)
    finally:
        await client.close()
    await store.close()


async def test_commits_move_to_the_second_master_when_the_first_stops(
    short_backoff: None,
) -> None:
    async with two_masters() as (first, second, client):
        epoch = await register(client, "a")
        assert await client.commit(commit("a", epoch, 1, (1, (0,)))) == 1
        assert first.service.counters.commit_links == 1
        await first.stop(grace=0.1)
        assert await client.commit(commit("a", epoch, 2, (2, (0,)))) == 2
        assert await client.commit(commit("a", epoch, 3, (3, (0,)))) == 3
        assert second.service.counters.commits == 2
        await asyncio.sleep(SHORT_BACKOFF[0] + 0.2)
        assert await client.commit(commit("a", epoch, 4, (4, (0,)))) == 4
        assert second.service.counters.commits == 3
        assert second.service.counters.commit_links == 1  # (its own commit port now)
        assert await holders(client, range(1, 5)) == [["a"]] * 4


async def test_a_master_stops_without_waiting_out_its_grace_for_an_idle_link() -> None:
    server = MasterServer(MasterConfig(grpc_port=0))
    await server.start()
    client = MasterClient(server.address, timeout_s=5)
    try:
        epoch = await register(client, "a")
        assert await client.commit(commit("a", epoch, 1, (1, (0,)))) == 1
        assert server.service.counters.commit_links == 1
        began = time.monotonic()
        await asyncio.wait_for(server.stop(grace=30.0), 20)
        assert time.monotonic() - began < 5.0, "stop waited out its grace for an idle link"
        with pytest.raises(Unreachable):
            await client.commit(commit("a", epoch, 2, (2, (0,))), timeout=2)
    finally:
        await client.close()
        await server.stop()


# -- what else comes to the port -----------------------------------------------------------------


async def _raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a plain socket; what comes back until the master closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    except ConnectionResetError:
        return b""
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def test_garbage_on_the_commit_port_is_closed_and_the_node_commits_on() -> None:
    async with running() as (server, client):
        assert server.commits is not None
        port, uri, counters = server.commits.port, uri_of(server), server.service.counters
        epoch = await register(client, "a")
        seq = 0

        async def node_commits() -> None:
            nonlocal seq
            seq += 1
            assert await client.commit(commit("a", epoch, seq, (seq, (0,)))) == seq

        await node_commits()
        assert await _raw(port, b"GET / HTTP/1.1\r\n\r\n") == b""
        await node_commits()
        assert await _raw(port, random.Random(7).randbytes(300)) == b""
        await node_commits()
        conn = await connect(uri, timeout=2)  # another op
        answer = await exchange(conn, {"op": "put", "key": "x"})
        assert (answer["op"], answer["code"]) == ("error", "protocol")
        await assert_closed(conn)
        await node_commits()
        conn = await connect(uri, timeout=2)  # a buffer that is not a CommitRequest
        answer = await exchange(conn, {"op": "commit"}, b"\xff" * 8)
        assert (answer["op"], answer["status"]) == ("refused", "INVALID_ARGUMENT")
        stale = batch_bytes(commit("ghost", 5, 1, (90, (0,))))  # (still usable: a verdict)
        answer = await exchange(conn, {"op": "commit"}, stale)
        assert (answer["op"], answer["status"]) == ("refused", "FAILED_PRECONDITION")
        await conn.close()
        await node_commits()
        conn = await connect(uri, timeout=2)  # two buffers
        await conn.send({"op": "commit"}, [stale, stale], timeout=2)
        await assert_closed(conn)
        await node_commits()
        assert (counters.commits, counters.commit_streams) == (seq, 0)
        assert await holders(client, range(1, seq + 1)) == [["a"]] * seq
        assert await holders(client, range(90, 91)) == [[]]


# -- auth and TLS --------------------------------------------------------------------------------


async def test_a_port_that_refuses_the_node_leaves_its_commits_to_grpc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A port at its connection limit answers the node's link with an error frame (here
    ``capacity``; any error that is not a verdict on the batch): the commit goes over gRPC
    instead of failing the node's put, and the port is left alone for the backoff."""
    monkeypatch.setattr(commit_port_module, "MAX_CONNECTIONS", 1)
    async with running() as (server, client):
        counters = server.service.counters
        holder = await connect(uri_of(server), timeout=2)  # takes the one slot, and keeps it
        answer = await exchange(holder, {"op": "commit"}, b"\xff" * 8)
        assert (answer["op"], answer["status"]) == ("refused", "INVALID_ARGUMENT")
        try:
            epoch = await register(client, "a")
            for seq in (1, 2, 3):
                assert await client.commit(commit("a", epoch, seq, (seq, (0,)))) == seq
            assert (counters.commit_links, counters.commit_streams, counters.commits) == (1, 1, 3)
            assert await holders(client, range(1, 4)) == [["a"]] * 3
        finally:
            await holder.close()


@contextlib.asynccontextmanager
async def master_with_auth(tmp: Path) -> AsyncIterator[MasterServer]:
    auth = AuthConfig.load(write_auth_file(tmp))
    server = MasterServer(MasterConfig(grpc_port=0), auth=auth)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=0.1)


async def test_with_a_cluster_secret_the_port_serves_node_tickets_only(tmp_path: Path) -> None:
    async with (
        master_with_auth(tmp_path) as server,
        MasterClient(server.address, timeout_s=5, token=SECRET) as node,
    ):
        counters, uri = server.service.counters, uri_of(server)
        epoch = await register(node, "a")
        assert await node.commit(commit("a", epoch, 1, (1, (0,)))) == 1
        assert (counters.commit_links, counters.commit_streams, counters.commits) == (1, 0, 1)
        sneaked = batch_bytes(commit("a", epoch, 2, (50, (0,))), node.session)

        conn = await connect(uri, timeout=2)  # no handshake
        answer = await exchange(conn, {"op": "commit"}, sneaked)
        assert (answer["op"], answer["code"]) == ("error", "unauthorized")
        await assert_closed(conn)

        conn = await dial(uri, 2, TicketSource.of_secret(SECRET, role="client"))
        answer = await exchange(conn, {"op": "commit"}, sneaked)
        assert (answer["op"], answer["code"]) == ("error", "forbidden")
        await assert_closed(conn)

        with pytest.raises(Unauthorized):  # another pool's secret: the master cannot prove it
            await dial(uri, 2, TicketSource.of_secret("another-pool-secret-0123456789"))

        assert (counters.commit_links, counters.commits) == (1, 1)
        assert await holders(node, range(50, 51)) == [[]]
        assert await node.commit(commit("a", epoch, 2, (2, (0,)))) == 2
        assert await holders(node, range(1, 3)) == [["a"], ["a"]]
        assert (counters.commit_links, counters.commit_streams) == (1, 0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_a_tls_master_takes_commits_over_tls(tmp_path: Path) -> None:
    from kvstore.transport.tls import server_context

    ca = make_ca(tmp_path, "ca")
    cert, key = make_signed(tmp_path, "server", ca, "IP:127.0.0.1,DNS:localhost")
    server = MasterServer(
        MasterConfig(grpc_port=0),
        tls=server_credentials(TlsFiles(cert=str(cert), key=str(key))),
        commit_tls=server_context(str(cert), str(key)),
    )
    await server.start()
    try:
        async with MasterClient(server.address, timeout_s=5, tls=TlsFiles(ca=str(ca[1]))) as node:
            epoch = await register(node, "a")
            for seq in (1, 2, 3):
                assert await node.commit(commit("a", epoch, seq, (seq, (0,)))) == seq
            counters = server.service.counters
            assert (counters.commit_links, counters.commit_streams, counters.commits) == (1, 0, 3)
            assert await holders(node, range(1, 4)) == [["a"]] * 3
        assert server.commits is not None
        assert await _raw(server.commits.port, b"KVF1" + bytes(8)) == b""  # plaintext: closed
        assert (server.service.counters.commit_links, server.service.counters.commits) == (1, 3)
    finally:
        await server.stop(grace=0.1)


async def test_a_port_out_of_reach_costs_one_dial_then_commits_go_over_grpc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dials: list[str] = []
    real_dial = commit_port_module.dial

    async def counted(uri: str, *args: Any) -> Connection:
        dials.append(uri)
        return await real_dial(uri, *args)

    monkeypatch.setattr(commit_port_module, "dial", counted)
    with socket.socket() as sock:  # a port nothing listens on (bound, then let go)
        sock.bind(("127.0.0.1", 0))
        nowhere = sock.getsockname()[1]
    async with running() as (server, client):
        server.service.commit_port = nowhere
        epoch = await register(client, "a")
        began = time.monotonic()
        for seq in range(1, 6):
            assert await client.commit(commit("a", epoch, seq, (seq, (0,)))) == seq
        assert time.monotonic() - began < 2.0
        assert dials == [f"tcp://127.0.0.1:{nowhere}"]
        counters = server.service.counters
        assert (counters.commit_links, counters.commits) == (0, 5)
        assert counters.commit_streams >= 1
        assert await holders(client, range(1, 6)) == [["a"]] * 5


async def test_a_port_that_never_answers_the_handshake_costs_a_commit_one_second(
    tmp_path: Path,
) -> None:
    """A port that takes connections and says nothing (a hung master, a box that is not
    one): the dial and its handshake together get 1 s, then the commit goes over gRPC."""
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    async def take() -> None:  # accept and keep every connection, answer nothing
        loop = asyncio.get_running_loop()
        silent.setblocking(False)
        while True:
            conn, _ = await loop.sock_accept(silent)
            held.append(conn)

    taker = asyncio.create_task(take())
    try:
        async with (
            master_with_auth(tmp_path) as server,
            MasterClient(server.address, timeout_s=5, token=SECRET) as node,
        ):
            server.service.commit_port = silent.getsockname()[1]
            epoch = await register(node, "a")
            began = time.monotonic()
            assert await node.commit(commit("a", epoch, 1, (1, (0,)))) == 1
            assert 0.9 < time.monotonic() - began < 2.5
            assert held, "the commit never dialled the silent port"
            counters = server.service.counters
            assert (counters.commit_links, counters.commit_streams, counters.commits) == (0, 1, 1)
    finally:
        taker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await taker
        for conn in held:
            conn.close()
        silent.close()


async def test_a_batch_the_store_cannot_apply_in_time_is_refused_deadline_exceeded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hung store: the port answers DEADLINE_EXCEEDED once the batch's apply time is up
    (as gRPC's deadline ends a call), and the connection serves the next batch."""
    monkeypatch.setattr(commit_port_module, "APPLY_S", 0.3)
    store = MemoryIndexStore()
    async with running(store=store) as (server, client):
        epoch = await register(client, "a")
        gate = stall_apply(store)
        conn = await connect(uri_of(server), timeout=2)
        try:
            data = batch_bytes(commit("a", epoch, 1, (1, (0,))), client.session)
            began = time.monotonic()
            answer = await exchange(conn, {"op": "commit"}, data)
            assert (answer["op"], answer["status"]) == ("refused", "DEADLINE_EXCEEDED")
            assert time.monotonic() - began < 2.0
            gate.set()
            answer = await exchange(conn, {"op": "commit"}, data)
            assert answer == {"op": "committed", "applied_seq": 1}
        finally:
            gate.set()
            await conn.close()
        assert await holders(client, range(1, 2)) == [["a"]]

"""The data port's challenge-response, with real processes: a master and nodes started with
one auth file, clients whose tickets come from the master (``DataTicket``), and the attacks
of a raw connection — a put or a read without a ticket, a ticket whose claims were changed,
an expired one, a recorded proof replayed, an evict by a client — each refused with a typed
error while the node keeps serving honest clients. A node that cannot prove the cluster
secret learns nothing from a client but its hello; a drain's copies between nodes
authenticate with the nodes' own tickets."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvclient
from kvstore.control.client import MasterClient
from kvstore.dataplane import NodeClient
from kvstore.dataplane.client import Dial
from kvstore.dataplane.handshake import (
    Challenge,
    Hello,
    Proof,
    Ticket,
    TicketSource,
    prove,
    ticket_root,
)
from kvstore.dataplane.messages import PutChunk
from kvstore.errors import KVTimeout, PermissionDenied, ProtocolError, Unauthorized, Unreachable
from kvstore.transport import connect, listen
from kvstore.transport.base import Connection
from tests.authfile import ADMIN, CLIENT, SECRET, write_auth_file
from tests.cluster import Server, run_kvctl, start_server
from tests.kvproc import layer_kv, namespace, prompt

pytestmark = pytest.mark.slow


def _node(master: Server, auth: Path, *extra: str) -> Server:
    return start_server("node", "--master", master.grpc, "--data-port", "0", "--metrics-port",
                        "0", "--host-mem", "64MiB", "--auth-file", str(auth), *extra)  # fmt: skip


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[Server, list[Server], Path]]:
    auth = write_auth_file(tmp_path)
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                          "--node-lease-s", "3", "--auth-file", str(auth))  # fmt: skip
    nodes: list[Server] = []
    try:
        nodes.append(_node(master, auth))
        yield master, nodes, auth
    finally:
        for node in nodes:
            node.stop()
        master.stop()


async def _ticket(token: str, master: Server) -> Ticket:
    async with MasterClient(master.grpc, token=token) as mc:
        ticket = await mc.data_ticket()
    assert ticket is not None
    return ticket


class _Fixed(TicketSource):
    """A ticket source that always hands out one given ticket (a forged or expired one)."""

    def __init__(self, ticket: Ticket) -> None:
        super().__init__(root=b"unused")
        self._fixed = ticket

    async def ticket(self, timeout: float | None = None) -> Ticket:
        return self._fixed


def _node_with(uri: str, ticket: Ticket | None) -> NodeClient:
    return NodeClient(uri, Dial(_Fixed(ticket) if ticket else None), timeout_s=5)


async def _put_one(node: NodeClient, kv: kvclient.KVClient, value: int) -> Any:
    data = bytearray([value]) * kv._chunk_bytes
    chunk = PutChunk(b"\x42" * 16, b"\x00" * 16, 0, len(data))
    return await node.put(kv.ns.canonical_bytes(), [chunk], [data])


async def test_a_ticket_opens_the_data_port_and_nothing_else_does(
    pool: tuple[Server, list[Server], Path],
) -> None:
    master, [node], _ = pool
    tokens = prompt(1024, seed=71)
    ns = namespace(1)
    async with await kvclient.KVClient.connect(master.grpc, ns, token=CLIENT) as kv:
        assert await kv.put_layer(tokens, 0, layer_kv(1024, 0, 71)) == 1024
        ticket = await _ticket(CLIENT, master)
        assert (ticket.role, ticket.tenant) == ("client", "team-a")
        root = ticket_root(SECRET)
        forged = [
            None,  # no handshake at all: the first frame is the request
            # the claims changed to admin, the client's key kept: the proofs differ
            dataclasses.replace(ticket, claims=ticket.claims.replace(b"client", b"admin")),
            # a ticket of another pool (another secret)
            Ticket.issue(ticket_root("another-pool-secret-012345"), "admin"),
            # expired an hour ago (signed right, so only the expiry refuses it)
            Ticket.issue(root, "client", "team-a", ttl_s=60, now=time.time() - 3600),
        ]
        for bad in forged:
            intruder = _node_with(node.data, bad)
            with pytest.raises(Unauthorized) as err:
                await intruder.stats()
            assert not isinstance(err.value, PermissionDenied), bad
            with pytest.raises(Unauthorized):  # a well-formed chunk put first: refused
                await _put_one(intruder, kv, 0x66)
        expired = forged[-1]
        assert expired is not None
        with pytest.raises(Unauthorized, match="expired"):
            await _node_with(node.data, expired).stats()
        # The honest client still reads its prompt, every byte.
        got = await kv.get_layer(tokens, 0)
        assert got.shape[1] == 1024
        assert await kv.match_prefix(tokens) == 1024
        # A client's ticket may not evict on a data port; an admin's may (kvctl evict).
        with pytest.raises(PermissionDenied, match="evict"):
            await _node_with(node.data, ticket).evict(ns.id, None)
        assert await kv.match_prefix(tokens) == 1024
        admin = await _ticket(ADMIN, master)
        # (the client's namespace is its tenant's: an admin names the tenant)
        untenanted = await _node_with(node.data, admin).evict(ns.id, None)
        assert untenanted.evicted == 0
        evicted = await _node_with(node.data, admin).evict(ns.id, None, tenant="team-a")
        assert evicted.evicted > 0
        deadline = time.monotonic() + 10
        while await kv.match_prefix(tokens) > 0:  # the node committed its evictions
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)


async def _raw_hello(uri: str, claims: bytes) -> tuple[Connection, Challenge, bytes]:
    conn = await connect(uri, timeout=5)
    nonce = os.urandom(16)
    await conn.send(Hello(claims, nonce).header(), timeout=5)
    frame = await conn.recv_header(timeout=5)
    return conn, Challenge.parse(frame.header), nonce


async def test_a_recorded_proof_does_not_open_a_second_connection(
    pool: tuple[Server, list[Server], Path],
) -> None:
    """An eavesdropper holds the claims and one exchange's proof, never the key: the node's
    next challenge has a fresh nonce, so the recorded proof does not answer it."""
    master, [node], _ = pool
    ticket = await _ticket(CLIENT, master)
    # A genuine exchange, as recorded on the wire.
    conn, challenge, nonce = await _raw_hello(node.data, ticket.claims)
    mac = hmac.digest(ticket.key, b"|".join([b"peer", challenge.nonce, nonce]), "sha256")
    await conn.send(Proof(mac).header(), timeout=5)
    await conn.send({"op": "stats"}, timeout=5)
    assert (await conn.recv_header(timeout=5)).header["op"] == "stats"
    await conn.close()
    # The replay: the same hello, the same proof.
    conn, again, _ = await _raw_hello(node.data, ticket.claims)
    assert again.nonce != challenge.nonce
    await conn.send(Proof(mac).header(), timeout=5)
    answer = (await conn.recv_header(timeout=5)).header
    assert answer["op"] == "error" and answer["code"] == "unauthorized", answer
    await conn.close()


async def test_a_node_without_the_secret_learns_only_the_hello(tmp_path: Path) -> None:
    """A listener posing as a node (it answers the hello with a proof it cannot compute):
    the client refuses it before sending its proof or any request."""
    seen: list[dict[str, Any]] = []

    async def impostor(conn: Connection) -> None:
        while not conn.closed:
            try:
                frame = await conn.recv_header(timeout=5)
            except Exception:
                return
            seen.append(frame.header)
            await conn.send(Challenge(os.urandom(16), os.urandom(32)).header(), timeout=5)

    listener = listen("tcp://127.0.0.1:0", impostor)
    async with listener:
        ticket = Ticket.issue(ticket_root(SECRET), "client", "team-a")
        with pytest.raises(Unauthorized, match="could not prove"):
            await NodeClient(listener.address, Dial(_Fixed(ticket)), timeout_s=5).stats()
        conn = await connect(listener.address, timeout=5)
        with pytest.raises(Unauthorized):
            await prove(conn, ticket, 5)
        await conn.close()
        await asyncio.sleep(0.2)
    assert [h["op"] for h in seen] == ["hello", "hello"]  # never a proof, never a request


def test_a_drain_copies_between_nodes_that_authenticate(
    pool: tuple[Server, list[Server], Path],
) -> None:
    """Two nodes with the secret; kvctl (an admin token from the environment) drains one:
    its copies reach the other over authenticated connections, and every block reads back
    after the drained node stops."""
    master, nodes, auth = pool
    nodes.append(_node(master, auth))
    tokens = prompt(2048, seed=73)

    async def write() -> list[torch.Tensor]:
        async with await kvclient.KVClient.connect(master.grpc, namespace(2), token=CLIENT) as kv:
            for layer in range(2):
                assert await kv.put_layer(tokens, layer, layer_kv(2048, layer, 73)) == 2048
            return [(await kv.get_layer(tokens, layer)).clone() for layer in range(2)]

    ref = asyncio.run(write())
    victim = nodes[0].addresses["node"]
    run = run_kvctl(master, "drain", victim, "--wait", "--wait-s", "60", "--json",
                    env={"KVSTORE_TOKEN": ADMIN}, timeout=90)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    moved = json.loads(run.stdout)
    assert moved["drain_failed"] == 0, moved
    nodes.pop(0).stop()

    async def read() -> None:
        async with await kvclient.KVClient.connect(master.grpc, namespace(2), token=CLIENT) as kv:
            deadline = time.monotonic() + 15
            while await kv.match_prefix(tokens) < 2048:  # the drained node's lease ended
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            for layer in range(2):
                assert torch.equal(await kv.get_layer(tokens, layer), ref[layer])

    asyncio.run(read())


async def test_ticket_source_refreshes_in_the_background_and_remembers_no_ticket() -> None:
    """A client's tickets: fetched once and reused; past half life the old one is handed
    out while one fetch of the next runs; a master that fails meanwhile costs nothing until
    the ticket expires, then the failure is raised; "no ticket" (no auth file, or a master
    too old for DataTicket) is remembered instead of asked for on every dial."""
    root = ticket_root(SECRET)
    answers: list[Any] = []
    calls = 0

    async def fetch() -> Ticket | None:
        nonlocal calls
        calls += 1
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[no-any-return]

    fresh = Ticket.issue(root, "client", "team-a")
    source = TicketSource(fetch)
    answers.append(fresh)
    assert await source.ticket(5) is fresh and await source.ticket(5) is fresh and calls == 1
    # Half life gone (a ticket of 60 s is past half of the hour at once), not expired:
    short = Ticket.issue(root, "client", "team-a", ttl_s=60)
    source = TicketSource(fetch)
    answers[:] = [short, Unreachable("master away"), fresh]
    assert await source.ticket(5) is short and calls == 2
    assert await source.ticket(5) is short  # served at once; the next fetch fails behind
    await asyncio.sleep(0.05)
    assert calls == 3
    assert await source.ticket(5) is short  # (and the next fetch again, in the background)
    await asyncio.sleep(0.05)
    assert await source.ticket(5) is fresh and calls == 4
    # Expired and the master away: the failure is raised, within the dial's timeout.
    gone = Ticket.issue(root, "client", "team-a", ttl_s=-3600)
    source = TicketSource(fetch)
    answers[:] = [gone, Unreachable("master away")]
    assert await source.ticket(5) is gone  # (a master's clock behind: the node allows skew)
    with pytest.raises(Unreachable):
        await source.ticket(5)  # the expired one is not handed out again
    # No ticket: asked once, then remembered; an old master (ProtocolError) likewise.
    for answer in (None, ProtocolError("UNIMPLEMENTED")):
        source, calls = TicketSource(fetch), 0
        answers[:] = [answer]
        assert await source.ticket(5) is None and await source.ticket(5) is None
        assert calls == 1
    # A fetch that hangs: the dial's timeout bounds the wait.
    never = asyncio.Event()

    async def hang() -> Ticket | None:
        await never.wait()
        return None

    with pytest.raises(KVTimeout):
        await TicketSource(hang).ticket(0.2)


def test_claims_past_the_bounds_are_refused_typed() -> None:
    """An anonymous hello's claims are parsed before any key is checked: a huge ``exp`` (an
    integer JSON allows, that float arithmetic does not), a non-string jti, a wrong version
    all are Unauthorized, never another exception."""
    root = ticket_root(SECRET)
    for claims in (
        b'{"v":1,"role":"admin","tenant":"","exp":1' + b"0" * 400 + b"}",
        b'{"v":1,"role":"admin","tenant":"","exp":-5}',
        b'{"v":1,"role":"admin","tenant":"","exp":5,"jti":7}',
        b'{"v":2,"role":"admin","tenant":"","exp":5}',
        b"[1, 2]",
        b"\xff\xfe",
    ):
        with pytest.raises(Unauthorized):
            Ticket.verify(root, claims, now=0)
    a, b = (Ticket.issue(root, "client", "team-a", now=0) for _ in range(2))
    assert a.claims != b.claims and a.key != b.key  # (jti: no two tickets share a key)


def test_a_node_with_secrets_refuses_a_master_without_them(tmp_path: Path) -> None:
    """A node started with the cluster secret next to a master without an auth file would
    refuse every client (they get no tickets there): it says so at start and exits."""
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "kvstore.cli", "node", "--master", master.grpc,
             "--data-port", "0", "--metrics-port", "0", "--host-mem", "32MiB",
             "--auth-file", str(write_auth_file(tmp_path))],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        master.stop()
    assert run.returncode != 0 and "its master has no auth file" in run.stderr, run.stderr
    assert "kvstore ready" not in run.stdout


async def test_an_unauthenticated_payload_gets_its_refusal_not_a_broken_pipe(
    pool: tuple[Server, list[Server], Path],
) -> None:
    """A put sent with no handshake carries a payload larger than the socket buffers: the
    node reads and drops it before refusing, so the peer's send completes and it learns
    why (Unauthorized), every time; before, it raced into a broken pipe (PeerDisconnected)."""
    _, [node], _ = pool
    data = bytearray(32 << 20)
    chunk = PutChunk(b"\x42" * 16, b"\x00" * 16, 0, len(data))
    intruder = _node_with(node.data, None)
    for _ in range(3):
        with pytest.raises(Unauthorized, match="authenticate first"):
            await intruder.put(b"kvstore-ns/3", [chunk], [data])


async def test_a_warm_up_skips_a_node_that_does_not_answer(
    pool: tuple[Server, list[Server], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """``warm_up`` dials every live node (here each dial authenticates, so a node must
    answer it); one that is frozen (SIGSTOP) is logged and skipped after the client's
    ``node_timeout_s``, not the end of the whole call: the other node is warmed up, and
    over ``ucx://`` reported ready."""
    import signal

    from kvclient.ucx import nixl_available

    master, nodes, auth = pool
    ucx = nixl_available()
    nodes.append(_node(master, auth, "--transport", "ucx" if ucx else "tcp"))
    frozen, live = nodes
    caplog.set_level("WARNING", logger="kvclient")
    async with await kvclient.KVClient.connect(
        master.grpc, namespace(1), token=CLIENT, timeout_s=8, node_timeout_s=1,
        staging_bytes=16 * 2**20,
    ) as kv:  # fmt: skip
        frozen.proc.send_signal(signal.SIGSTOP)
        try:
            assert await kv.warm_up() == ([live.data] if ucx else [])
        finally:
            frozen.proc.send_signal(signal.SIGCONT)
        skipped = [r.getMessage() for r in caplog.records if "not dialled" in r.getMessage()]
        assert len(skipped) == 1 and frozen.data in skipped[0], skipped
        tokens = prompt(512, seed=73)
        assert await kv.put_layer(tokens, 0, layer_kv(512, 0, 73)) == 512

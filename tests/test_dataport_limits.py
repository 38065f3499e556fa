"""The node's data port and metrics port cannot be held hostage.

Idle sockets, a header trickled a byte at a time, prefixes that announce a header and never
send it, and connection floods each cost a bounded, short-lived share of a node; a client
the node turns away raises a typed :class:`CapacityError` that names the limit, and a
pooled connection the node closed while it sat idle is dialled anew without the caller
noticing. Real ``kvstore serve`` processes on loopback (their guards set small through the
CLI), plus in-process servers where a test needs its own bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import resource
import select
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import torch

import kvclient
from kvclient.pool import ConnectionPool
from kvstore.errors import CapacityError, PeerDisconnected, ProtocolError
from kvstore.metrics import DEFAULT_SCRAPE_CONNECTIONS, Metrics, MetricsServer
from kvstore.node.server import NodeConfig
from kvstore.transport import DEFAULT_MAX_CONNECTIONS, Connection, connect, listen
from kvstore.transport.framing import MAGIC, encode_prefix, parse_prefix
from tests.cluster import Server, start_server

MiB = 2**20
CAP = 8
"""``--max-connections`` of the guarded node."""
IDLE_S = 2.0
"""``--idle-timeout-s`` of the guarded node: long enough that a test's own pauses between
exchanges (milliseconds) stay far below it."""
HEADER_S = 0.5
"""``--header-timeout-s`` of the guarded node."""

NS = kvclient.Namespace(model="dataport-limits", revision="1", num_layers=1, num_kv_heads=2,
                        head_dim=64, dtype=torch.bfloat16, block_tokens=16,
                        quant="none")  # fmt: skip

PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,"
    "text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
)
"""The Accept header Prometheus 3 sends with every scrape."""


def _serve(*flags: str) -> Iterator[Server]:
    srv = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port", "0",
                       "--host-mem", "64MiB", *flags)  # fmt: skip
    try:
        yield srv
    finally:
        rc, out = srv.stop()
        assert rc == 0, out


@pytest.fixture(scope="module")
def guarded() -> Iterator[Server]:
    """A node with small guards: 8 connections, 2 s idle, 0.5 s per header."""
    yield from _serve("--max-connections", str(CAP), "--idle-timeout-s", str(IDLE_S),
                      "--header-timeout-s", str(HEADER_S))  # fmt: skip


@pytest.fixture(scope="module")
def plain() -> Iterator[Server]:
    """A node with every guard at its default."""
    yield from _serve()


# -- helpers -----------------------------------------------------------------------------------


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


@contextlib.contextmanager
def _raw_sockets(port: int, n: int) -> Iterator[list[socket.socket]]:
    """``n`` plain TCP connections to ``127.0.0.1:port``, closed on exit."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _closed_by_peer(sock: socket.socket, wait_s: float) -> bool:
    """Whether the peer closes ``sock`` within ``wait_s`` (bytes before the close are
    drained, at most 64 KiB)."""
    deadline = time.monotonic() + wait_s
    for _ in range(64):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            return False
        try:
            if not sock.recv(1024):
                return True
        except ConnectionError:
            return True
    return False


def _frame_from(sock: socket.socket, wait_s: float = 5.0) -> dict:
    """The header of the next frame ``sock`` receives."""
    sock.settimeout(wait_s)
    data = b""
    for _ in range(64):
        chunk = sock.recv(65536)
        assert chunk, f"closed after {len(data)} bytes, before a whole frame"
        data += chunk
        with contextlib.suppress(ProtocolError):
            return parse_prefix(data)[0].header
    raise AssertionError("no whole frame in 64 reads")


async def _client(srv: Server) -> kvclient.KVClient:
    return await kvclient.KVClient.connect(srv.grpc, NS, timeout_s=10)


def _prompt(seed: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (32,), generator=g).tolist()
    return tokens, torch.randn(2, 32, 2, 64, generator=g).bfloat16()


async def _put_and_get(kv: kvclient.KVClient, seed: int) -> None:
    """Put two blocks of layer 0 and read them back intact."""
    tokens, kv_layer = _prompt(seed)
    assert await kv.put_layer(tokens, 0, kv_layer) == 32
    got = await kv.get_layer(tokens, 0)
    assert torch.equal(got, kv_layer)


async def _stats(conn: Connection) -> dict:
    await conn.send({"op": "stats"}, timeout=5)
    return (await conn.recv_header(timeout=5)).header


async def _settled(srv: Server) -> None:
    """Wait (bounded) until the node serves a new connection: earlier tests' sockets gone."""
    for _ in range(100):
        try:
            async with await connect(srv.data, timeout=5) as conn:
                if (await _stats(conn)).get("op") == "stats":
                    return
        except PeerDisconnected:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{srv.data} kept refusing connections")


# -- defect 1: idle sockets and the connection bound -----------------------------------------


async def test_a_flood_of_idle_sockets_never_resets_a_put(plain: Server) -> None:
    """The report: idle sockets fill the node's connection bound (defaults: 1024) and a
    legitimate put then died on a bare connection reset. Now it is served (it displaced an
    idle socket older than the header timeout) or refused with a CapacityError that names
    the limit — never a reset."""
    await _settled(plain)
    kv = await _client(plain)
    async with kv:
        with _raw_sockets(_port(plain.data), DEFAULT_MAX_CONNECTIONS):
            tokens, layer = _prompt(10)
            try:
                await kv.put_layer(tokens, 0, layer)
            except CapacityError as exc:
                assert f"limit of {DEFAULT_MAX_CONNECTIONS} connections" in str(exc)
        await _settled(plain)
        await _put_and_get(kv, seed=10)


async def test_idle_sockets_cannot_keep_a_put_out(guarded: Server) -> None:
    """Fill the bound with idle sockets and a few more: the extra ones get a capacity
    refusal frame, and once the idle ones are older than the header timeout a real client's
    put displaces one and is served."""
    await _settled(guarded)
    with _raw_sockets(_port(guarded.data), CAP + 3) as socks:
        await asyncio.sleep(HEADER_S + 0.2)  # refusals arrive at once; the rest are idle
        refused = select.select(socks, [], [], 0)[0]
        # 3, or 4 while the node still counted the probe connection of _settled()
        assert len(refused) in (3, 4)
        for sock in refused:
            refusal = _frame_from(sock)
            assert refusal["op"] == "error" and refusal["code"] == "capacity"
            assert f"limit of {CAP} connections" in refusal["message"]
        idle = [s for s in socks if s not in refused]
        kv = await _client(guarded)
        async with kv:
            await _put_and_get(kv, seed=1)
        # The oldest made room (well before the idle timeout would have closed it) ...
        assert _closed_by_peer(idle[0], 0.2), "the oldest idle socket was not displaced"
        # ... and left alone, every idle socket is closed after the idle timeout.
        assert all(_closed_by_peer(s, IDLE_S + 5) for s in idle)


async def test_sockets_held_idle_after_a_request_cannot_keep_a_put_out(guarded: Server) -> None:
    """Found by trying the product: a peer that sent one request on each of ``CAP``
    connections (a tenant's, authenticated) and then held them idle kept every other
    client out until the idle timeout, and could reopen them. A connection that has waited
    at least the header timeout for its next request is displaced, longest first."""
    await _settled(guarded)
    held = [await connect(guarded.data, timeout=5) for _ in range(CAP)]
    try:
        for conn in held:
            assert (await _stats(conn)).get("op") == "stats"
        await asyncio.sleep(HEADER_S + 0.2)  # (each idle past the header timeout)
        kv = await _client(guarded)
        async with kv:
            await _put_and_get(kv, seed=2)
    finally:
        for conn in held:
            await conn.close()


async def test_a_refused_client_gets_a_typed_error_and_served_clients_go_on(
    guarded: Server,
) -> None:
    """At the bound with every connection in use, a new client's put raises CapacityError
    naming the limit; a client already connected keeps being served."""
    await _settled(guarded)
    served = await _client(guarded)
    refused = await _client(guarded)  # talks to the master now, to the node only later
    async with served, refused:
        await _put_and_get(served, seed=2)  # one pooled connection, kept
        busy = [await connect(guarded.data, timeout=5) for _ in range(CAP - 1)]
        try:
            for conn in busy:  # each has exchanged a frame: not displaceable
                assert (await _stats(conn))["op"] == "stats"
            tokens, layer = _prompt(3)
            with pytest.raises(CapacityError, match=f"limit of {CAP} connections"):
                await refused.put_layer(tokens, 0, layer)
            await _put_and_get(served, seed=4)
        finally:
            for conn in busy:
                await conn.close()
        for _ in range(100):  # the node notices the closes at once; bounded anyway
            with contextlib.suppress(CapacityError):
                await _put_and_get(refused, seed=3)
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("still refused after the busy connections closed")


async def test_pool_redials_a_connection_the_node_closed_idle(guarded: Server) -> None:
    """A pooled connection the node closed after its idle timeout is dialled anew: the next
    put and get succeed (a get on the dead connection would have been a silent miss)."""
    await _settled(guarded)
    kv = await _client(guarded)
    async with kv:
        await _put_and_get(kv, seed=5)
        await asyncio.sleep(IDLE_S + 0.5)  # the node closes the pooled connection meanwhile
        await _put_and_get(kv, seed=6)
        tokens, layer = _prompt(5)
        assert torch.equal(await kv.get_layer(tokens, 0), layer)


async def test_pool_retires_a_kept_connection_before_the_node_would_close_it() -> None:
    async def echo(conn: Connection) -> None:
        while True:
            await conn.send((await conn.recv_header()).header)

    async with listen("tcp://127.0.0.1:0", echo) as listener:
        pool = ConnectionPool(max_idle_s=0.1)
        try:
            async with pool.use(listener.address, 5) as first:
                assert (await _stats(first))["op"] == "stats"
            async with pool.use(listener.address, 5) as again:
                assert again is first  # kept and reused while fresh
            await asyncio.sleep(0.2)
            async with pool.use(listener.address, 5) as fresh:
                assert fresh is not first and first.closed
                assert (await _stats(fresh))["op"] == "stats"
        finally:
            await pool.close()


# -- defect 3: a header trickled a byte at a time --------------------------------------------


async def test_a_trickled_header_is_dropped(guarded: Server) -> None:
    """One byte per 0.1 s of a ~60-byte request: the node drops the connection once the
    header is late (0.5 s after its first byte), long before it is complete, although no
    single gap comes near the idle timeout."""
    await _settled(guarded)
    frame = encode_prefix({"op": "stats", "pad": "x" * 30}, [])
    with _raw_sockets(_port(guarded.data), 1) as (sock,):
        dropped_at = None
        for i in range(len(frame)):
            try:
                sock.send(frame[i : i + 1])
            except ConnectionError:
                dropped_at = i
                break
            if _closed_by_peer(sock, 0.1):
                dropped_at = i
                break
        assert dropped_at is not None and dropped_at < len(frame) - 1
    async with await connect(guarded.data, timeout=5) as conn:  # everyone else is served
        assert (await _stats(conn))["op"] == "stats"


# -- defect 2: memory for a header follows the bytes received --------------------------------


def _announce(header_bytes: int) -> bytes:
    """The 12 fixed prefix bytes of a frame with no payload and a ``header_bytes`` header."""
    return MAGIC + struct.pack("<BBHI", 0, 0, 0, header_bytes)


async def test_announced_headers_cost_only_the_bytes_received(plain: Server) -> None:
    """200 connections each announce a ~500 KB header (within the node's limit) and send 12
    bytes: the node, still holding them all, grew by far less than the ~100 MiB an up-front
    allocation takes (measured before the fix: +112 MiB for 100 x 1 MiB)."""
    await _settled(plain)
    pid = plain.proc.pid
    before = _rss_kib(pid)
    with _raw_sockets(_port(plain.data), 200) as socks:
        for sock in socks:
            sock.sendall(_announce(500_000))
        async with await connect(plain.data, timeout=5) as conn:
            await _stats(conn)  # accepted after the 200: their first reads have run
        grown = 0
        for _ in range(6):
            grown = max(grown, _rss_kib(pid) - before)
            await asyncio.sleep(0.05)
        held = [s for s in socks if not select.select([s], [], [], 0)[0]]
        assert len(held) == 200, "the node dropped connections: nothing was measured"
    assert grown < 48 * 1024, f"node RSS grew {grown} KiB for 200 announced headers"


async def test_a_header_over_the_node_limit_is_refused_at_once(plain: Server) -> None:
    """The node accepts headers up to 512 KiB: announcing 1 MiB closes the connection before
    anything is allocated or waited for."""
    await _settled(plain)
    with _raw_sockets(_port(plain.data), 1) as (sock,):
        sock.sendall(_announce(MiB))
        assert _closed_by_peer(sock, 5)


async def test_the_largest_legitimate_request_fits_the_node_header_limit(plain: Server) -> None:
    """A put naming 4096 chunks, every field at its widest, is read whole by the node (it
    answers the request, here refusing its made-up namespace) rather than dropped."""
    spec = [[os.urandom(16).hex(), os.urandom(16).hex(), 99_999, 2**30] for _ in range(4096)]
    header = {"op": "put", "ns": "zz" * 4096, "chunks": spec, "wait_s": 10.123456789}
    assert len(encode_prefix(header, [])) <= NodeConfig(master="unused").max_header_bytes
    async with await connect(plain.data, timeout=5) as conn:
        await conn.send(header, timeout=5)
        answer = (await conn.recv_header(timeout=5)).header
    assert answer["op"] == "error" and "ns" in answer["message"], answer


# -- the fd limit ------------------------------------------------------------------------------

_FD_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, resource, sys
    from kvstore.transport import listen

    soft, hard = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    async def echo(conn):
        while True:
            frame = await conn.recv_header()
            await conn.send(frame.header)

    def refusal(exc):
        return {"op": "error", "code": "capacity", "message": str(exc)}

    async def main():
        async with listen("tcp://127.0.0.1:0", echo, max_connections=1024,
                          refusal=refusal) as listener:
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            print(json.dumps({"address": listener.address, "limit": limit,
                              "max_connections": listener.max_connections}), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio.run(main())
    """
)


@contextlib.contextmanager
def _listener_process(soft: int, hard: int) -> Iterator[dict]:
    """A bare ``tcp://`` listener (max_connections 1024) in a process whose RLIMIT_NOFILE
    starts at (soft, hard); yields what it reports once bound."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _FD_SCRIPT, str(soft), str(hard)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "the listener process did not start"
        yield json.loads(proc.stdout.readline())
        proc.stdin.close()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)


def test_listener_raises_a_low_soft_fd_limit_to_fit_its_bound() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = 2**20 if hard == resource.RLIM_INFINITY else hard
    if hard < 2048:
        pytest.skip(f"hard RLIMIT_NOFILE {hard} leaves no room to raise the soft one")
    with _listener_process(256, hard) as info:
        assert info["max_connections"] == 1024
        assert info["limit"] > 1024


async def test_listener_bound_sits_below_a_low_hard_fd_limit() -> None:
    """Hard limit 400: the listener serves fewer than 400 connections and refuses the next
    with a capacity frame, never failing on EMFILE."""
    with _listener_process(400, 400) as info:
        cap = info["max_connections"]
        assert 1 <= cap < 400 and info["limit"] == 400
        conns = [await connect(info["address"], timeout=5) for _ in range(cap + 5)]
        try:
            for conn in conns[:cap]:
                await conn.send({"op": "ping"}, timeout=5)
                assert (await conn.recv_header(timeout=5)).header == {"op": "ping"}
            for conn in conns[cap:]:
                refusal = (await conn.recv_header(timeout=5)).header
                assert refusal["code"] == "capacity" and f"limit of {cap}" in refusal["message"]
        finally:
            for conn in conns:
                await conn.close()


# -- defect 4: the metrics endpoint --------------------------------------------------------


def test_idle_metrics_connections_do_not_cost_a_thread_each(plain: Server) -> None:
    """100 idle connections to a node's metrics port: its thread count stays within the
    scrape bound (a thread per connection before: +100), the extra ones are answered 503,
    and once they are gone a scrape works."""
    pid, port = plain.proc.pid, _port(plain.addresses["metrics"])
    before = _threads(pid)
    with _raw_sockets(port, 100) as socks:
        grown = 0
        for _ in range(5):
            grown = max(grown, _threads(pid) - before)
            time.sleep(0.05)
        assert grown <= DEFAULT_SCRAPE_CONNECTIONS + 2, f"{grown} more threads"
        assert _frame_status(socks[-1]) == 503
    for _ in range(100):
        with contextlib.suppress(urllib.error.HTTPError):
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            assert b"kvstore_pool_bytes" in body
            return
        time.sleep(0.05)
    raise AssertionError("the metrics port kept refusing after the idle sockets closed")


def _frame_status(sock: socket.socket, wait_s: float = 5.0) -> int:
    """The status code of the HTTP response ``sock`` receives."""
    sock.settimeout(wait_s)
    line = sock.recv(64).split(b"\r\n", 1)[0]
    return int(line.split()[1])


@pytest.fixture
def metrics_server() -> Iterator[MetricsServer]:
    """An in-process metrics server with small bounds: 2 at once, 0.3 s, 1 KiB."""
    m = Metrics()
    m.blocks.labels(role="node").set(7)
    threads = threading.active_count()
    srv = MetricsServer(m, "127.0.0.1", 0, max_connections=2, timeout_s=0.3,
                        max_request_bytes=1024)  # fmt: skip
    try:
        yield srv
    finally:
        srv.close()
    assert threading.active_count() <= threads


def _request(srv: MetricsServer, head: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` and read the whole response: status, headers, body."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
        sock.sendall(head)
        data = b""
        for _ in range(1000):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    raw, _, body = data.partition(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def test_metrics_serves_a_prometheus_scrape(metrics_server: MetricsServer) -> None:
    scrape = (
        f"GET /metrics HTTP/1.1\r\nHost: {metrics_server.address}\r\n"
        f"User-Agent: Prometheus/3.1.0\r\nAccept: {PROMETHEUS_ACCEPT}\r\n"
        "Accept-Encoding: gzip\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n"
    ).encode()
    assert len(scrape) < 512
    status, headers, body = _request(metrics_server, scrape)
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    text = gzip.decompress(body).decode()
    assert 'kvstore_blocks{role="node"} 7.0' in text and text.endswith("# EOF\n")
    plain_text = urllib.request.urlopen(f"http://{metrics_server.address}/metrics", timeout=5)
    assert plain_text.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b'kvstore_blocks{role="node"} 7.0' in plain_text.read()
    filtered = b"GET /metrics?name[]=kvstore_blocks HTTP/1.1\r\n\r\n"
    status, _, body = _request(metrics_server, filtered)
    assert status == 200 and b"kvstore_blocks" in body and b"kvstore_pool_bytes" not in body
    status, headers, body = _request(metrics_server, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
    assert _request(metrics_server, b"GET /nothing HTTP/1.1\r\n\r\n")[0] == 404
    assert _request(metrics_server, b"POST /metrics HTTP/1.1\r\n\r\n")[0] == 405
    assert _request(metrics_server, b"garbage\r\n\r\n")[0] == 400


def test_metrics_bounds_connections_and_drops_idle_ones(metrics_server: MetricsServer) -> None:
    """Two idle connections fill the bound: a third is answered 503 at once; the idle ones
    are answered 408 and closed after the timeout, and then scrapes are served again."""
    with _raw_sockets(metrics_server.port, 2) as idle:
        for _ in range(100):  # bounded: until the server has taken both
            if metrics_server.connections == 2:
                break
            time.sleep(0.01)
        with _raw_sockets(metrics_server.port, 1) as (extra,):
            assert _frame_status(extra) == 503
        assert [_frame_status(s) for s in idle] == [408, 408]
        assert all(_closed_by_peer(s, 5) for s in idle)
    assert metrics_server.refused == 1
    assert _request(metrics_server, b"GET /metrics HTTP/1.1\r\n\r\n")[0] == 200


def test_metrics_drops_a_trickled_request(metrics_server: MetricsServer) -> None:
    """A request sent a byte per 0.05 s never completes within the 0.3 s deadline."""
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nUser-Agent: slow\r\n\r\n"
    with _raw_sockets(metrics_server.port, 1) as (sock,):
        status = None
        for i in range(len(request)):
            with contextlib.suppress(ConnectionError):
                sock.send(request[i : i + 1])
            if select.select([sock], [], [], 0.05)[0]:
                status = _frame_status(sock)
                break
        assert status == 408 and i < len(request) - 1


def test_metrics_refuses_an_oversized_request(metrics_server: MetricsServer) -> None:
    huge = b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 64 * 1024 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", metrics_server.port), timeout=5) as sock:
        with contextlib.suppress(ConnectionError):
            sock.sendall(huge)
        assert _frame_status(sock) == 431
    assert _request(metrics_server, b"GET /metrics HTTP/1.1\r\n\r\n")[0] == 200

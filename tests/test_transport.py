"""Transport conformance: every backend behaves alike (framing, views, limits, errors, stop).

Each case runs over every entry of ``CASES``; a new backend (``ucx``) is one more entry.
Cases that need to put raw, partial or garbage bytes on the wire run where the backend can
(``raw_bytes``): the in-process twin moves whole frames only, so it cannot be handed half a
frame, and ``tls://`` bytes on the wire are ciphertext (a garbage peer there fails the
handshake). ``tls://`` runs with a CA and certificate made here by ``openssl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import socket
import ssl
import struct
import tempfile
import tracemalloc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import (
    Closed,
    InvalidArgument,
    KVTimeout,
    PeerDisconnected,
    ProtocolError,
    TransportError,
    UnknownScheme,
    Unreachable,
)
from kvstore.transport import (
    BACKENDS,
    Connection,
    FrameLimits,
    Listener,
    as_byte_view,
    connect,
    listen,
)
from kvstore.transport.base import PROGRESS_BYTES, with_timeout
from kvstore.transport.framing import (
    FIXED_SIZE,
    MAGIC,
    encode_prefix,
    parse_fixed,
    parse_prefix,
)
from tests.certs import make_ca, make_signed

MiB = 1024 * 1024


@dataclass(frozen=True)
class Case:
    """How to exercise one backend."""

    name: str
    any_address: str
    """Listen here to get a fresh address (port 0, generated name)."""
    raw_bytes: bool
    """Raw bytes can be written to a listener (partial frames, garbage)."""

    def nowhere(self) -> str:
        """An address where nothing listens."""
        if self.name in ("tcp", "tls"):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                return f"{self.name}://127.0.0.1:{sock.getsockname()[1]}"
        return f"{self.name}://nobody-listens-here"

    def listen_options(self) -> dict[str, Any]:
        return {"ssl_context": _tls_contexts()[0]} if self.name == "tls" else {}

    async def connect(self, uri: str, *args: Any, **kw: Any) -> Connection:
        """``connect`` with this backend's options (tls://: the test CA)."""
        extra = {"ssl_context": _tls_contexts()[1]} if self.name == "tls" else {}
        return await connect(uri, *args, **extra, **kw)


@functools.cache
def _tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server and a client context from a CA and a 127.0.0.1 certificate made here."""
    from kvstore.transport.tls import client_context, server_context

    d = Path(tempfile.mkdtemp(prefix="kvstore-tls-"))
    ca = make_ca(d, "ca")
    cert, key = make_signed(d, "node", ca, "IP:127.0.0.1")
    contexts = server_context(str(cert), str(key)), client_context(str(ca[1]))
    shutil.rmtree(d)
    return contexts


CASES = {
    "tcp": Case("tcp", "tcp://127.0.0.1:0", raw_bytes=True),
    "tls": Case("tls", "tls://127.0.0.1:0", raw_bytes=False),
    "inproc": Case("inproc", "inproc://", raw_bytes=False),
}


@pytest.fixture(params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


@pytest.fixture
def raw_case(case: Case) -> Case:
    if not case.raw_bytes:
        why = "its bytes are ciphertext" if case.name == "tls" else "it moves whole frames only"
        pytest.skip(f"{case.name}://: no raw bytes to inject ({why})")
    return case


@pytest.fixture(autouse=True)
async def no_leaks() -> AsyncIterator[None]:
    """Every test ends with no task of ours running and no file descriptor left open."""
    fds = len(os.listdir("/proc/self/fd"))
    yield
    await asyncio.sleep(0)
    current = asyncio.current_task()
    alive = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    assert alive == []
    assert len(os.listdir("/proc/self/fd")) <= fds


async def echo(conn: Connection) -> None:
    """Send every frame back, header and payload."""
    while True:
        frame = await conn.recv_header()
        await conn.send(frame.header, await conn.recv_payload())


@contextlib.asynccontextmanager
async def serving(case: Case, handler: Any = echo, **kw: Any) -> AsyncIterator[Listener]:
    listener = listen(case.any_address, handler, **case.listen_options(), **kw)
    await listener.start()
    try:
        yield listener
    finally:
        await listener.stop(grace=1)


@contextlib.asynccontextmanager
async def accepted(case: Case, **kw: Any) -> AsyncIterator[tuple[Listener, asyncio.Queue]]:
    """A listener whose handler hands each server-side connection to the test."""
    conns: asyncio.Queue[Connection] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(conn: Connection) -> None:
        await conns.put(conn)
        await done.wait()

    async with serving(case, handler, **kw) as listener:
        try:
            yield listener, conns
        finally:
            done.set()


@contextlib.asynccontextmanager
async def pair(case: Case, **kw: Any) -> AsyncIterator[tuple[Connection, Connection]]:
    """(client, server) connections of one link."""
    client_limits = kw.pop("client_limits", FrameLimits())
    async with accepted(case, **kw) as (listener, conns):
        client = await case.connect(listener.address, timeout=5, limits=client_limits)
        try:
            yield client, await asyncio.wait_for(conns.get(), 5)
        finally:
            await client.close()


@contextlib.asynccontextmanager
async def raw_socket(address: str) -> AsyncIterator[tuple[asyncio.StreamReader, Any]]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def read_until_eof(reader: asyncio.StreamReader) -> bytes:
    with contextlib.suppress(ConnectionError):
        return await asyncio.wait_for(reader.read(), 5)
    return b""


# -- frames ----------------------------------------------------------------------------------


async def test_header_only_frames_both_ways(case: Case) -> None:
    async with pair(case) as (client, server):
        header = {"op": "ping", "n": 1, "text": "grüße", "list": [1, 2.5, None, True]}
        await client.send(header)
        frame = await server.recv_header(timeout=5)
        assert frame.header == header and frame.sizes == []
        assert await server.recv_payload() == []
        await server.send({"op": "pong"})
        assert await client.recv(timeout=5) == ({"op": "pong"}, [])
        assert client.bytes_sent == server.bytes_received > 0
        assert server.bytes_sent == client.bytes_received > 0


async def test_multi_buffer_frame_of_every_buffer_kind(case: Case) -> None:
    tensor = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    buffers = [
        b"bytes",
        bytearray(b"bytearray"),
        memoryview(b"0123456789")[2:7],
        np.arange(10, dtype=np.uint8),
        np.arange(6, dtype=np.float32).reshape(2, 3),
        torch.arange(7, dtype=torch.uint8),
        tensor,
        b"",
    ]
    async with pair(case) as (client, server):
        await client.send({"op": "put"}, buffers)
        header, payload = await server.recv(timeout=5)
        assert header == {"op": "put"}
        assert [bytes(p) for p in payload] == [bytes(as_byte_view(b)) for b in buffers]
        assert bytes(payload[6]) == tensor.view(torch.uint8).numpy().tobytes()
        assert all(isinstance(p, bytearray) for p in payload)


async def test_recv_into_numpy_torch_and_slot_views(case: Case) -> None:
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (100, 4096, 70_000, 3)]
    arena = bytearray(200_000)  # e.g. slots of a storage arena, received into in place
    slot = memoryview(arena)[1000:71_000]
    np_out = np.zeros(100, dtype=np.uint8)
    torch_out = torch.zeros(1024, dtype=torch.float32)  # 4096 bytes, a non-uint8 tensor
    tiny = torch.zeros(3, dtype=torch.uint8)
    async with pair(case) as (client, server):
        send = asyncio.create_task(client.send({"op": "data"}, parts))
        frame = await server.recv_header(timeout=5)
        assert frame.sizes == [100, 4096, 70_000, 3]
        await server.recv_payload_into([np_out, torch_out, slot, tiny], timeout=5)
        await send
    assert np.array_equal(np_out, parts[0])
    assert torch_out.view(torch.uint8).numpy().tobytes() == parts[1].tobytes()
    assert bytes(slot) == parts[2].tobytes()
    assert arena[:1000] == bytes(1000) and arena[71_000:] == bytes(200_000 - 71_000)
    assert tiny.numpy().tobytes() == parts[3].tobytes()


async def test_on_progress_reports_each_view_filling_in_order(case: Case) -> None:
    rng = np.random.default_rng(2)
    sizes = (3 * PROGRESS_BYTES + 1000, 7, 0, 90_000, 5, 300_000)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    outs: list[bytearray | None] = [bytearray(n) for n in sizes]
    outs[3] = None  # discarded: never reported
    seen: list[tuple[int, int]] = []

    def on_progress(i: int, upto: int) -> None:
        out = outs[i]
        assert out is not None, "a discarded buffer is not reported"
        # Everything reported has arrived: the caller may read it at once.
        assert bytes(out[:upto]) == parts[i][:upto].tobytes()
        seen.append((i, upto))

    async with pair(case) as (client, server):
        send = asyncio.create_task(client.send({"op": "data"}, parts))
        await server.recv_header(timeout=5)
        await server.recv_payload_into(outs, timeout=5, on_progress=on_progress)
        await send
    assert [i for i, _ in seen] == sorted(i for i, _ in seen), "views in order"
    for i, size in enumerate(sizes):
        ups = [upto for j, upto in seen if j == i]
        if outs[i] is None:
            assert not ups
            continue
        assert ups and ups[-1] == size, f"view {i} reported complete once it is"
        assert ups == sorted(ups) and len(set(ups)) == len(ups), "each report is new bytes"
        if case.name == "tcp":  # a socket is read in cache-sized pieces
            steps = np.diff([0, *ups])
            assert all(step <= PROGRESS_BYTES for step in steps), steps


async def _one_layout(
    client: Connection, server: Connection, rng: np.random.Generator, round_: int
) -> None:
    count = int(rng.integers(1, 40))
    sizes = [int(rng.choice([0, 1, 70, 4096, 65_536 + 72, 200_000])) for _ in range(count)]
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    outs: list[bytearray | None] = [bytearray(n) if rng.random() > 0.2 else None for n in sizes]
    watch = bool(round_ % 2)
    seen: dict[int, list[int]] = {}

    def on_progress(i: int, upto: int) -> None:
        assert outs[i] is not None and upto <= sizes[i]
        assert not seen or max(seen) <= i, "views in order"
        seen.setdefault(i, []).append(upto)

    async def both() -> None:
        await client.send({"round": round_}, parts)
        await client.send({"after": round_})

    send = asyncio.create_task(both())
    assert (await server.recv_header(timeout=5)).header == {"round": round_}
    await server.recv_payload_into(outs, timeout=5, on_progress=on_progress if watch else None)
    await send
    for i, out in enumerate(outs):
        if out is None:
            assert i not in seen
            continue
        assert bytes(out) == parts[i].tobytes(), (round_, i)
        if watch:
            assert seen[i][-1] == sizes[i], (round_, i, seen.get(i))
    assert (await server.recv_header(timeout=5)).header == {"after": round_}


async def test_many_buffers_per_frame_land_in_place_with_and_without_progress(
    case: Case,
) -> None:
    """Random layouts: tiny, empty, discarded and large buffers, frames back to back; every
    byte lands in its own view, the next frame stays framed, progress (when watched) is
    reported in order up to each view's size."""
    rng = np.random.default_rng(11)
    async with pair(case) as (client, server):
        for round_ in range(24):
            await _one_layout(client, server, rng, round_)


async def test_none_views_discard_and_stream_stays_in_sync(case: Case) -> None:
    async with pair(case) as (client, server):
        await client.send({"i": 0}, [b"a" * 10, b"b" * 100_000, b"c" * 5])
        await client.send({"i": 1}, [b"d" * 70_000])
        await client.send({"i": 2}, [b"e"])
        frame = await server.recv_header(timeout=5)
        keep = bytearray(100_000)
        await server.recv_payload_into([None, keep, None], timeout=5)
        assert frame.header == {"i": 0} and keep == b"b" * 100_000
        assert (await server.recv_header(timeout=5)).header == {"i": 1}
        await server.discard_payload(timeout=5)
        assert await server.recv(timeout=5) == ({"i": 2}, [bytearray(b"e")])
        assert server.bytes_received == client.bytes_sent


async def test_wrong_views_raise_protocol_error_and_keep_payload(case: Case) -> None:
    async with pair(case) as (client, server):
        await client.send({"op": "data"}, [b"x" * 10, b"y" * 20])
        await server.recv_header(timeout=5)
        with pytest.raises(ProtocolError, match="buffer 1 is 20 bytes"):
            await server.recv_payload_into([bytearray(10), bytearray(21)], timeout=5)
        with pytest.raises(ProtocolError, match="2 payload buffers"):
            await server.recv_payload_into([bytearray(10)], timeout=5)
        with pytest.raises(InvalidArgument, match="read-only"):
            await server.recv_payload_into([bytearray(10), b"z" * 20], timeout=5)
        with pytest.raises(InvalidArgument, match="unread"):
            await server.recv_header(timeout=5)
        assert await server.recv_payload(timeout=5) == [b"x" * 10, b"y" * 20]
        assert not server.closed


async def test_a_whole_payload_lands_back_to_back_in_one_view(case: Case) -> None:
    """``recv_payload_whole``: many buffers (some staged with the prefix, one larger than
    a socket read) into one view, in order; a view of the wrong size or a read-only one
    leaves the payload pending; the stream stays in sync for the next frames."""
    parts = [bytes([65 + i]) * n for i, n in enumerate((10, 1352, 3, 200_000, 1352, 1))]
    async with pair(case) as (client, server):
        await client.send({"i": 0}, parts)
        await client.send({"i": 1}, [b"q" * 7])
        assert (await server.recv_header(timeout=5)).header == {"i": 0}
        total = sum(map(len, parts))
        with pytest.raises(ProtocolError, match=f"buffer 0 is {total} bytes"):
            await server.recv_payload_whole(bytearray(total - 1), timeout=5)
        with pytest.raises(InvalidArgument, match="read-only"):
            await server.recv_payload_whole(b"z" * total, timeout=5)
        whole = np.zeros(total, dtype=np.uint8)
        await server.recv_payload_whole(whole, timeout=5)
        assert whole.tobytes() == b"".join(parts)
        with pytest.raises(InvalidArgument, match="no frame payload"):
            await server.recv_payload_whole(bytearray(1), timeout=5)
        assert await server.recv(timeout=5) == ({"i": 1}, [bytearray(b"q" * 7)])
        assert server.bytes_received == client.bytes_sent and not server.closed


async def test_large_payload_integrity(case: Case) -> None:
    data = np.random.default_rng(2).integers(0, 256, 64 * MiB, dtype=np.uint8)
    out = np.empty_like(data)
    async with pair(case) as (client, server):
        send = asyncio.create_task(client.send({"op": "big"}, [data[: 40 * MiB], data[40 * MiB :]]))
        frame = await server.recv_header(timeout=10)
        assert frame.payload_bytes == 64 * MiB
        await server.recv_payload_into([out[: 40 * MiB], out[40 * MiB :]], timeout=30)
        await send
    assert np.array_equal(out, data)


async def test_many_concurrent_connections(case: Case) -> None:
    async def one_client(address: str, i: int) -> bytes:
        async with await case.connect(address, timeout=5) as conn:
            payload = [os.urandom(1000 + i), bytes([i]) * (i * 997)]
            for round_ in range(3):
                await conn.send({"client": i, "round": round_}, payload)
                header, back = await conn.recv(timeout=10)
                assert header == {"client": i, "round": round_}
                assert back == payload
            return payload[0]

    async with serving(case) as listener:
        firsts = await asyncio.gather(*(one_client(listener.address, i) for i in range(64)))
    assert len(set(firsts)) == 64


async def test_concurrent_sends_on_one_connection_do_not_interleave(case: Case) -> None:
    async with pair(case) as (client, server):
        payloads = {i: os.urandom(50_000 + i) for i in range(20)}
        sends = [client.send({"i": i}, [payloads[i], b"tail"]) for i in payloads]
        sending = asyncio.gather(*sends)
        for _ in payloads:
            header, back = await server.recv(timeout=10)
            assert back == [payloads[header["i"]], b"tail"]
        await sending


async def test_concurrent_sends_larger_than_the_socket_buffer_do_not_interleave(
    case: Case,
) -> None:
    """Frames the kernel cannot take at once: the first send writes part of its frame at
    once and finishes it while the others wait their turn, none spliced into it."""
    async with pair(case) as (client, server):
        payloads = {i: os.urandom(4 * 2**20 + i) for i in range(6)}
        sending = asyncio.gather(*(client.send({"i": i}, [payloads[i]]) for i in payloads))
        for _ in payloads:
            header, back = await server.recv(timeout=10)
            assert back == [payloads[header["i"]]]
        await sending
        assert client.bytes_sent == server.bytes_received


async def test_second_concurrent_reader_is_refused(case: Case) -> None:
    async with pair(case) as (client, server):
        first = asyncio.create_task(server.recv_header(timeout=5))
        await asyncio.sleep(0.01)
        with pytest.raises(InvalidArgument, match="already receiving"):
            await server.recv_header(timeout=5)
        await client.send({"op": "x"})
        assert (await first).header == {"op": "x"}


# -- disconnects and timeouts ----------------------------------------------------------------


async def test_peer_close_delivers_sent_frames_then_disconnects(case: Case) -> None:
    async with pair(case) as (client, server):
        await client.send({"last": True}, [b"payload"])
        await client.close()
        assert await server.recv(timeout=5) == ({"last": True}, [b"payload"])
        with pytest.raises(PeerDisconnected):
            await server.recv_header(timeout=5)
        assert server.closed
        with pytest.raises(PeerDisconnected):
            await server.recv_header(timeout=5)


async def test_peer_close_wakes_a_blocked_recv(case: Case) -> None:
    async with pair(case) as (client, server):
        waiting = asyncio.create_task(server.recv_header(timeout=5))
        await asyncio.sleep(0.01)
        await client.close()
        with pytest.raises(PeerDisconnected):
            await waiting


async def test_local_close_is_idempotent_and_wakes_recv(case: Case) -> None:
    async with pair(case) as (client, _server):
        waiting = asyncio.create_task(client.recv_header(timeout=5))
        await asyncio.sleep(0.01)
        await client.close()
        await client.close()
        assert client.closed
        with pytest.raises(Closed):
            await waiting
        with pytest.raises(Closed):
            await client.send({"op": "late"})


async def test_peer_close_mid_frame(raw_case: Case) -> None:
    async with accepted(raw_case) as (listener, conns), raw_socket(listener.address) as (_, w):
        w.write(encode_prefix({"op": "data"}, [MiB]) + b"x" * 1000)
        await w.drain()
        server = await asyncio.wait_for(conns.get(), 5)
        assert (await server.recv_header(timeout=5)).sizes == [MiB]
        w.close()
        with pytest.raises(PeerDisconnected, match="mid-frame"):
            await server.recv_payload(timeout=5)
        assert server.closed


async def test_header_timeout_leaves_connection_usable(case: Case) -> None:
    async with pair(case) as (client, server):
        with pytest.raises(KVTimeout):
            await server.recv_header(timeout=0.05)
        with pytest.raises(KVTimeout):
            await server.recv(timeout=0.05)
        assert not server.closed
        await client.send({"op": "after"}, [b"late"])
        assert await server.recv(timeout=5) == ({"op": "after"}, [b"late"])


async def test_cancelled_header_wait_leaves_connection_usable(case: Case) -> None:
    async with pair(case) as (client, server):
        waiting = asyncio.create_task(server.recv_header())
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await client.send({"op": "after"})
        assert (await server.recv_header(timeout=5)).header == {"op": "after"}


async def test_header_timeout_mid_prefix_resumes(raw_case: Case) -> None:
    frame = encode_prefix({"op": "split"}, [4]) + b"abcd"
    async with accepted(raw_case) as (listener, conns), raw_socket(listener.address) as (_, w):
        w.write(frame[:5])
        await w.drain()
        server = await asyncio.wait_for(conns.get(), 5)
        with pytest.raises(KVTimeout):
            await server.recv_header(timeout=0.05)
        w.write(frame[5:])
        await w.drain()
        assert await server.recv(timeout=5) == ({"op": "split"}, [b"abcd"])


async def test_payload_timeout_closes_the_connection(raw_case: Case) -> None:
    async with accepted(raw_case) as (listener, conns), raw_socket(listener.address) as (r, w):
        w.write(encode_prefix({"op": "data"}, [1000]) + b"x" * 10)
        await w.drain()
        server = await asyncio.wait_for(conns.get(), 5)
        await server.recv_header(timeout=5)
        with pytest.raises(KVTimeout):
            await server.recv_payload(timeout=0.05)
        assert server.closed
        assert await read_until_eof(r) == b""
        with pytest.raises(Closed):
            await server.recv_header(timeout=5)


async def test_a_payload_wait_asks_for_its_bytes_and_a_header_wait_for_one(
    raw_case: Case,
) -> None:
    """A payload receive that runs dry waits for up to 512 KiB of what the frame still owes
    (SO_RCVLOWAT; at most a quarter of the receive buffer), however the sender trickles the
    rest; the next header wait asks for one byte again, so a 20-byte frame wakes it."""
    size = 1 * MiB
    payload = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8).tobytes()
    async with accepted(raw_case) as (listener, conns), raw_socket(listener.address) as (_, w):
        w.write(encode_prefix({"op": "data"}, [size]) + payload[:100_000])
        await w.drain()
        server = await asyncio.wait_for(conns.get(), 5)
        await server.recv_header(timeout=5)
        into = np.zeros(size, dtype=np.uint8)
        seen: list[int] = []
        task = asyncio.create_task(
            server.recv_payload_into([into], 10, lambda _i, upto: seen.append(upto))
        )
        sock = server._sock  # type: ignore[attr-defined]
        for _ in range(200):  # (bounded: until the receive has run dry and waits)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) > 1:
                break
            await asyncio.sleep(0.005)
        mark = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
        room = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4
        assert mark == min(512 * 1024, room, size - 100_000)
        for at in range(100_000, size, 48_000):  # trickled: no write is the mark's size
            w.write(payload[at : at + 48_000])
            await w.drain()
            await asyncio.sleep(0.002)
        await asyncio.wait_for(task, 10)
        assert into.tobytes() == payload
        assert seen[-1] == size and seen == sorted(seen)
        header = asyncio.create_task(server.recv_header(timeout=5))
        await asyncio.sleep(0.05)  # (the header wait has begun, with nothing to read)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        w.write(encode_prefix({"op": "ping"}, []))
        await w.drain()
        assert (await asyncio.wait_for(header, 5)).header == {"op": "ping"}


async def test_with_timeout_cancels_the_wait_at_its_deadline_not_before() -> None:
    loop = asyncio.get_running_loop()
    cleaned: list[bool] = []

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(True)

    began = loop.time()
    with pytest.raises(KVTimeout, match=r"the wait timed out after 0\.05 s"):
        await with_timeout(forever(), 0.05, "the wait")
    assert loop.time() - began >= 0.05
    assert cleaned == [True]  # the awaited operation was cancelled, its cleanup ran
    assert await with_timeout(asyncio.sleep(0, "done"), 5, "after") == "done"


async def test_with_timeout_fires_a_short_deadline_behind_long_ones() -> None:
    """Deadlines share one timer: a short one after long ones must re-arm it earlier, and
    one after a timer that fired for an entry already gone must still fire."""
    never = asyncio.Event()
    long_waits = [asyncio.create_task(with_timeout(never.wait(), 60, "long")) for _ in range(3)]
    await asyncio.sleep(0)
    assert await with_timeout(asyncio.sleep(0.01, 7), 0.05, "quick") == 7  # ends first
    for timeout in (0.05, 0.1):  # the first fires the timer armed for "quick"'s deadline
        with pytest.raises(KVTimeout, match="short"):
            await asyncio.wait_for(with_timeout(never.wait(), timeout, "short"), 5)
    assert not any(task.done() for task in long_waits)
    for task in long_waits:
        task.cancel()
    assert all(r is not None for r in await asyncio.gather(*long_waits, return_exceptions=True))


async def test_with_timeout_lets_a_cancellation_from_elsewhere_through() -> None:
    waiting = asyncio.create_task(with_timeout(asyncio.Event().wait(), 5, "wait"))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_with_timeout_nested_each_deadline_raises_its_own() -> None:
    never = asyncio.Event()

    async def inner_times_out() -> str:
        with pytest.raises(KVTimeout, match="inner"):
            await with_timeout(never.wait(), 0.02, "inner")
        await asyncio.sleep(0.01)  # the task is not left cancelled by the inner timeout
        return "outer went on"

    assert await with_timeout(inner_times_out(), 5, "outer") == "outer went on"
    with pytest.raises(KVTimeout, match="outer"):
        await with_timeout(with_timeout(never.wait(), 5, "inner"), 0.02, "outer")


async def test_with_timeout_clears_its_cancellation_when_the_wait_swallows_it() -> None:
    """As asyncio.timeout: a deadline's cancellation that the awaited code catches is
    taken back, so the task is not left marked as being cancelled."""
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0

    async def stubborn() -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "caught"
        return "never"

    assert await with_timeout(stubborn(), 0.02, "stubborn") == "caught"
    assert task.cancelling() == 0
    await asyncio.sleep(0.01)  # and the task goes on


async def test_with_timeout_many_concurrent_deadlines_each_fire_once() -> None:
    """Forty waits with deadlines 10-49 ms, half of which finish first: the ones that finish
    return, every other one raises its own timeout."""
    never = asyncio.Event()

    async def one(i: int) -> int:
        work = asyncio.sleep(0.001, i) if i % 2 else never.wait()
        return await with_timeout(work, 0.01 + i / 1000, f"wait {i}")  # type: ignore[arg-type]

    results = await asyncio.gather(*(one(i) for i in range(40)), return_exceptions=True)
    for i, result in enumerate(results):
        if i % 2:
            assert result == i
        else:
            assert isinstance(result, KVTimeout) and f"wait {i} timed out" in str(result)


# -- bad input ---------------------------------------------------------------------------------


async def test_garbage_closes_only_that_connection(raw_case: Case) -> None:
    seen: list[type[BaseException]] = []

    async def recording_echo(conn: Connection) -> None:
        try:
            await echo(conn)
        except Exception as exc:
            seen.append(type(exc))
            raise

    async with serving(raw_case, recording_echo) as listener:
        async with await raw_case.connect(listener.address, timeout=5) as good:
            async with raw_socket(listener.address) as (r, w):
                w.write(os.urandom(64 * 1024))
                with contextlib.suppress(ConnectionError):
                    await w.drain()
                assert await read_until_eof(r) == b""
            await good.send({"op": "still"}, [b"alive"])
            assert await good.recv(timeout=5) == ({"op": "still"}, [b"alive"])
        async with await raw_case.connect(listener.address, timeout=5) as fresh:
            await fresh.send({"op": "new"})
            assert await fresh.recv(timeout=5) == ({"op": "new"}, [])
    assert ProtocolError in seen


@pytest.mark.parametrize(
    ("header", "sizes", "match"),
    [
        ({"pad": "x" * 2000}, [], "header"),
        ({"op": "data"}, [600_000, 600_000], "payload"),
        ({"op": "data"}, [1] * 9, "buffers"),
    ],
    ids=["header", "payload", "buffers"],
)
async def test_frame_over_receiver_limits_is_refused(
    case: Case, header: dict, sizes: list[int], match: str
) -> None:
    small = FrameLimits(max_header_bytes=1024, max_buffers=8, max_payload_bytes=MiB)
    async with pair(case, limits=small) as (client, server):
        buffers = [bytes(n) for n in sizes]
        with contextlib.suppress(PeerDisconnected):
            sending = asyncio.create_task(client.send(header, buffers))
            with pytest.raises(ProtocolError, match=match):
                await server.recv_header(timeout=5)
            assert server.closed
            await sending
        with pytest.raises(PeerDisconnected):
            await client.recv_header(timeout=5)


async def test_huge_declared_sizes_are_refused_before_allocation(raw_case: Case) -> None:
    lying = FrameLimits(max_buffer_bytes=2**62, max_payload_bytes=2**62)
    async with accepted(raw_case) as (listener, conns), raw_socket(listener.address) as (r, w):
        w.write(encode_prefix({"op": "data"}, [2**61], lying))
        await w.drain()
        server = await asyncio.wait_for(conns.get(), 5)
        with pytest.raises(ProtocolError, match="limits"):
            await server.recv_header(timeout=5)
        assert await read_until_eof(r) == b""


async def test_sender_refuses_frames_over_its_own_limits(case: Case) -> None:
    async with pair(case, client_limits=FrameLimits(max_payload_bytes=100)) as (client, server):
        with pytest.raises(InvalidArgument, match="limits"):
            await client.send({"op": "data"}, [bytes(101)])
        with pytest.raises(InvalidArgument, match="JSON"):
            await client.send({"op": object()})
        with pytest.raises(InvalidArgument, match="buffer"):
            await client.send({"op": "data"}, ["not bytes"])
        assert not client.closed
        await client.send({"op": "fine"}, [bytes(100)])
        assert (await server.recv(timeout=5))[0] == {"op": "fine"}


# -- addresses, registry, listener lifecycle ---------------------------------------------------


async def test_unknown_scheme_lists_known_schemes() -> None:
    for uri in ("foo://somewhere:1", "127.0.0.1:50052"):
        with pytest.raises(UnknownScheme) as info:
            await connect(uri, timeout=1)
        assert all(f"{scheme}://" in str(info.value) for scheme in BACKENDS)
    with pytest.raises(UnknownScheme, match="tcp://"):
        listen("udp://127.0.0.1:0", echo)


async def test_connect_where_nothing_listens_is_unreachable(case: Case) -> None:
    with pytest.raises(Unreachable):
        await case.connect(case.nowhere(), timeout=5)


async def test_connect_timeout(raw_case: Case) -> None:
    with socket.socket() as full:  # backlog 0, never accepting: the second SYN is dropped
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        address = f"tcp://127.0.0.1:{full.getsockname()[1]}"
        first = await raw_case.connect(address, timeout=5)
        try:
            with pytest.raises(KVTimeout, match="connect"):
                await raw_case.connect(address, timeout=0.2)
        finally:
            await first.close()


async def test_unresolvable_host_is_unreachable() -> None:
    with pytest.raises(Unreachable):
        await connect("tcp://no-such-host.invalid:50052", timeout=5)


async def test_malformed_tcp_addresses() -> None:
    for uri in ("tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:99999", "tcp://:80"):
        with pytest.raises(InvalidArgument):
            await connect(uri, timeout=1)


async def test_port_zero_gives_a_real_address(case: Case) -> None:
    async with serving(case) as listener:
        assert listener.address != case.any_address
        assert listener.address.startswith(f"{case.name}://")
        if case.name == "tcp":
            assert int(listener.address.rsplit(":", 1)[1]) > 0
        async with await case.connect(listener.address, timeout=5) as conn:
            await conn.send({"op": "hello"})
            assert (await conn.recv(timeout=5))[0] == {"op": "hello"}


async def test_address_in_use_is_a_transport_error(case: Case) -> None:
    async with serving(case) as first:
        second = listen(first.address, echo, **case.listen_options())
        with pytest.raises(TransportError):
            await second.start()


async def test_listener_stop_closes_idle_connections(case: Case) -> None:
    ended: list[type[BaseException]] = []

    async def handler(conn: Connection) -> None:
        try:
            await echo(conn)
        except BaseException as exc:
            ended.append(type(exc))
            raise

    listener = listen(case.any_address, handler, **case.listen_options())
    await listener.start()
    clients = [await case.connect(listener.address, timeout=5) for _ in range(3)]
    for conn in clients:
        await conn.send({"op": "warm"})
        await conn.recv(timeout=5)
    await asyncio.wait_for(listener.stop(grace=30), 10)  # idle: closed without the grace
    assert ended == [Closed] * 3 and listener.connections == 0
    for conn in clients:
        with pytest.raises(PeerDisconnected):
            await conn.recv_header(timeout=5)
        await conn.close()
    with pytest.raises(Unreachable):
        await case.connect(listener.address, timeout=5)


async def test_listener_stop_lets_a_busy_exchange_finish(case: Case) -> None:
    busy = asyncio.Event()

    async def slow_echo(conn: Connection) -> None:
        while True:
            header, payload = await conn.recv(timeout=5)
            busy.set()
            await asyncio.sleep(0.2)  # e.g. the master commit of a put
            await conn.send(header, payload)

    listener = listen(case.any_address, slow_echo, **case.listen_options())
    await listener.start()
    async with await case.connect(listener.address, timeout=5) as client:
        await client.send({"op": "put"}, [b"chunk"])
        await busy.wait()
        stopping = asyncio.create_task(listener.stop(grace=10))
        assert await client.recv(timeout=5) == ({"op": "put"}, [b"chunk"])
        with pytest.raises(PeerDisconnected):
            await client.recv_header(timeout=5)
        await stopping


async def test_listener_stop_cancels_handlers_after_grace(case: Case) -> None:
    async def stuck(conn: Connection) -> None:
        await asyncio.sleep(3600)

    listener = listen(case.any_address, stuck, **case.listen_options())
    await listener.start()
    async with await case.connect(listener.address, timeout=5) as client:
        await asyncio.sleep(0.01)
        assert listener.connections == 1
        await listener.stop(grace=0.05)
        assert listener.connections == 0
        with pytest.raises(PeerDisconnected):
            await client.recv_header(timeout=5)


async def test_connection_bound_rejects_extra_connections(case: Case) -> None:
    async with serving(case, max_connections=2) as listener:
        first = await case.connect(listener.address, timeout=5)
        second = await case.connect(listener.address, timeout=5)
        for conn in (first, second):
            await conn.send({"op": "ping"})
            await conn.recv(timeout=5)
        if case.name == "tls":  # (closed before the handshake: the dial itself fails)
            with pytest.raises(PeerDisconnected):
                await case.connect(listener.address, timeout=5)
            third = first
        else:
            third = await case.connect(listener.address, timeout=5)
            with pytest.raises(PeerDisconnected):
                await third.recv_header(timeout=5)
        assert listener.rejected == 1 and listener.connections == 2
        for conn in (first, second, third):
            await conn.close()


async def test_handler_exception_closes_only_its_connection(case: Case) -> None:
    async def picky(conn: Connection) -> None:
        while True:
            header, payload = await conn.recv(timeout=5)
            if header.get("boom"):
                raise RuntimeError("handler bug")
            await conn.send(header, payload)

    async with serving(case, picky) as listener:
        victim = await case.connect(listener.address, timeout=5)
        bystander = await case.connect(listener.address, timeout=5)
        async with victim, bystander:
            await victim.send({"boom": True})
            with pytest.raises(PeerDisconnected):
                await victim.recv_header(timeout=5)
            await bystander.send({"op": "ok"}, [b"1"])
            assert await bystander.recv(timeout=5) == ({"op": "ok"}, [b"1"])


async def test_peer_and_byte_counters(case: Case) -> None:
    async with pair(case) as (client, server):
        assert client.peer.startswith(f"{case.name}://")
        assert server.peer.startswith(f"{case.name}://")
        await client.send({"op": "x"}, [bytes(1000)])
        await server.recv(timeout=5)
        assert server.bytes_received == client.bytes_sent
        assert client.bytes_sent == len(encode_prefix({"op": "x"}, [1000])) + 1000


# -- guards: idle, slow and surplus peers -----------------------------------------------------


def capacity_refusal(exc: Exception) -> dict[str, Any]:
    """A refusal frame as the node builds it."""
    return {"op": "error", "code": "capacity", "message": str(exc)}


async def eventually(check: Callable[[], bool]) -> bool:
    """Poll ``check`` for up to 5 s."""
    for _ in range(500):
        if check():
            return True
        await asyncio.sleep(0.01)
    return False


async def ping(conn: Connection, n: int = 0) -> None:
    await conn.send({"op": "ping", "n": n})
    assert (await conn.recv(timeout=5))[0] == {"op": "ping", "n": n}


async def test_idle_timeout_closes_a_silent_connection(case: Case) -> None:
    ended: list[type[BaseException]] = []

    async def recording_echo(conn: Connection) -> None:
        try:
            await echo(conn)
        except BaseException as exc:
            ended.append(type(exc))
            raise

    async with serving(case, recording_echo, idle_timeout=0.2) as listener:
        async with await case.connect(listener.address, timeout=5) as client:
            await ping(client)
            with pytest.raises(PeerDisconnected):
                await client.recv_header(timeout=5)
        assert await eventually(lambda: ended == [Closed] and listener.connections == 0)


async def test_idle_timeout_spares_a_connection_in_use(case: Case) -> None:
    """Twenty exchanges 50 ms apart: far more silence in all than the 0.6 s idle timeout,
    but never that much at once."""
    async with serving(case, idle_timeout=0.6) as listener:
        client = await case.connect(listener.address, timeout=5)
        async with client:
            for n in range(20):
                await ping(client, n)
                await asyncio.sleep(0.05)
            assert not client.closed and listener.connections == 1


async def test_a_wait_with_its_own_timeout_is_not_an_idle_wait(case: Case) -> None:
    async with pair(case, idle_timeout=0.05) as (client, server):
        with pytest.raises(KVTimeout):
            await server.recv_header(timeout=0.3)
        assert not server.closed
        await client.send({"op": "late"})
        assert (await server.recv_header(timeout=5)).header == {"op": "late"}


async def test_header_deadline_drops_a_trickle(raw_case: Case) -> None:
    frame = encode_prefix({"op": "slow", "pad": "x" * 40}, [])
    async with (
        accepted(raw_case, header_timeout=0.3) as (listener, conns),
        raw_socket(listener.address) as (r, w),
    ):
        w.write(frame[:1])
        await w.drain()
        server = await asyncio.wait_for(conns.get(), 5)
        receiving = asyncio.create_task(server.recv_header())
        for i in range(1, len(frame)):  # a byte per 50 ms: the frame would take 2.6 s
            if receiving.done():
                break
            with contextlib.suppress(ConnectionError):
                w.write(frame[i : i + 1])
                await w.drain()
            await asyncio.sleep(0.05)
        with pytest.raises(KVTimeout, match=r"header took longer than 0\.3 s"):
            await receiving
        assert server.closed and i < len(frame) - 1
        assert await read_until_eof(r) == b""


async def test_header_deadline_runs_from_the_first_byte_across_waits(raw_case: Case) -> None:
    frame = encode_prefix({"op": "split"}, [])
    async with (
        accepted(raw_case, header_timeout=0.4) as (listener, conns),
        raw_socket(listener.address) as (_, w),
    ):
        w.write(frame[:3])
        await w.drain()
        server = await asyncio.wait_for(conns.get(), 5)
        for _ in range(2):
            with pytest.raises(KVTimeout):
                await server.recv_header(timeout=0.05)
            assert not server.closed  # the caller's own deadline: still usable
        with pytest.raises(KVTimeout, match="header took longer"):
            await server.recv_header(timeout=30)
        assert server.closed


async def test_prefix_memory_follows_the_bytes_received(raw_case: Case) -> None:
    """Eight prefixes announce a 4 MiB header and send 1 KB of it: receiving them allocates
    nothing near the 32 MiB announced; the one then sent whole still arrives intact."""
    big = FrameLimits(max_header_bytes=16 * MiB)
    header = {"pad": "x" * (4 * MiB)}
    frame = encode_prefix(header, [], big)
    async with (
        accepted(raw_case, limits=big) as (listener, conns),
        contextlib.AsyncExitStack() as stack,
    ):
        socks = [await stack.enter_async_context(raw_socket(listener.address)) for _ in range(8)]
        for _, w in socks:
            w.write(frame[: FIXED_SIZE + 1000])
            await w.drain()
        servers = [await asyncio.wait_for(conns.get(), 5) for _ in socks]
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for server in servers:
                with pytest.raises(KVTimeout):
                    await server.recv_header(timeout=0.05)
            grown = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        assert grown < 2 * MiB, f"{grown} bytes allocated for 8 KB received"
        receiving = asyncio.create_task(servers[0].recv_header(timeout=5))
        _, w = socks[0]
        w.write(frame[FIXED_SIZE + 1000 :])
        await w.drain()
        assert (await receiving).header == header


async def test_refusal_frame_at_the_connection_bound(case: Case) -> None:
    async with serving(case, max_connections=2, refusal=capacity_refusal) as listener:
        first = await case.connect(listener.address, timeout=5)
        second = await case.connect(listener.address, timeout=5)
        for conn in (first, second):
            await ping(conn)
        third = await case.connect(listener.address, timeout=5)
        refusal = (await third.recv_header(timeout=5)).header
        assert refusal["code"] == "capacity"
        assert "limit of 2 connections" in refusal["message"]
        with pytest.raises(PeerDisconnected):
            await third.recv_header(timeout=5)
        assert listener.rejected == 1 and listener.connections == 2
        for conn in (first, second):
            await ping(conn, 1)  # the ones served are untouched
        for conn in (first, second, third):
            await conn.close()


async def test_a_refused_client_reads_its_refusal_after_sending_a_big_request(
    case: Case,
) -> None:
    """The refused side reads and drops what the client sends while the refusal waits to
    be read, so a client still writing its request never meets a reset instead."""
    async with serving(case, max_connections=1, refusal=capacity_refusal) as listener:
        first = await case.connect(listener.address, timeout=5)
        async with first:
            await ping(first)
            second = await case.connect(listener.address, timeout=5)
            async with second:
                await second.send({"op": "put", "pad": "x" * 600_000}, [bytes(MiB)], timeout=5)
                assert (await second.recv_header(timeout=5)).header["code"] == "capacity"


async def test_a_connection_that_never_sent_a_byte_is_displaced_at_the_bound(
    case: Case,
) -> None:
    async with serving(
        case, max_connections=2, header_timeout=0.2, refusal=capacity_refusal
    ) as listener:
        used = await case.connect(listener.address, timeout=5)
        await ping(used)
        silent = await case.connect(listener.address, timeout=5)
        await asyncio.sleep(0.3)  # older than the header timeout, and still silent
        newcomer = await case.connect(listener.address, timeout=5)
        await ping(newcomer)
        with pytest.raises(PeerDisconnected):
            await silent.recv_header(timeout=5)
        await ping(used, 1)
        assert listener.displaced == 1 and listener.rejected == 0
        for conn in (used, silent, newcomer):
            await conn.close()


async def test_a_burst_at_the_bound_displaces_each_silent_connection_once(case: Case) -> None:
    """Three newcomers at once, two silent connections to make room: each is displaced once
    (a displaced one stays listed until its handler ends) and the third newcomer refused."""
    async with serving(
        case, max_connections=2, header_timeout=0.2, refusal=capacity_refusal
    ) as listener:
        silent = [await case.connect(listener.address, timeout=5) for _ in range(2)]
        await asyncio.sleep(0.3)
        newcomers = [await case.connect(listener.address, timeout=5) for _ in range(3)]
        assert await eventually(lambda: listener.displaced + listener.rejected == 3)
        assert (listener.displaced, listener.rejected) == (2, 1)
        assert await eventually(lambda: listener.connections == 2)
        for conn in silent:
            with pytest.raises(PeerDisconnected):
                await conn.recv_header(timeout=5)
        for conn in (*silent, *newcomers):
            await conn.close()


async def test_reusable_tells_a_kept_connection_from_a_spent_one(case: Case) -> None:
    async with pair(case) as (client, server):
        assert client.reusable() and server.reusable()
        await client.send({"op": "data"}, [b"abc"])
        await server.recv_header(timeout=5)
        assert not server.reusable()  # a payload is pending
        await server.recv_payload(timeout=5)
        assert server.reusable()
        await server.send({"op": "unasked"})
        assert await eventually(lambda: not client.reusable())
    async with pair(case) as (client, server):
        await server.close()
        assert await eventually(lambda: not client.reusable())
        with pytest.raises(PeerDisconnected):
            await client.recv_header(timeout=5)


async def test_listener_guards_validate(case: Case) -> None:
    for bad in ({"idle_timeout": 0}, {"header_timeout": -1.0}, {"idle_timeout": "5"}):
        with pytest.raises(InvalidArgument):
            listen(case.any_address, echo, **case.listen_options(), **bad)


# -- framing (pure) ----------------------------------------------------------------------------


def test_prefix_layout_matches_the_documented_bytes() -> None:
    prefix = encode_prefix({"a": 1}, [5, 2**29])
    body = b'{"a":1}'
    assert prefix[:4] == MAGIC and prefix[4:6] == b"\0\0"
    assert struct.unpack("<HI", prefix[6:12]) == (2, len(body))
    assert struct.unpack("<2Q", prefix[12:28]) == (5, 2**29)
    assert prefix[28:] == body and FIXED_SIZE == 12


@given(
    header=st.dictionaries(
        st.text(max_size=8),
        st.one_of(st.integers(), st.text(max_size=20), st.booleans(), st.none()),
        max_size=6,
    ),
    sizes=st.lists(st.integers(min_value=0, max_value=MiB), max_size=20),
)
def test_prefix_round_trip(header: dict, sizes: list[int]) -> None:
    prefix = encode_prefix(header, sizes)
    frame, length = parse_prefix(prefix + b"payload follows")
    assert (frame.header, frame.sizes, length) == (header, sizes, len(prefix))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"KVF1\0\0", "truncated"),
        (b"HTTP/1.1 200 OK\r\n", "magic"),
        (b"KVF1\x01\0\0\0\2\0\0\0{}", "flags"),
        (b"KVF1\0\0\0\0\0\0\0\0", "header"),
        (b"KVF1\0\0\0\0\2\0\0\0[]", "JSON object"),
        (b"KVF1\0\0\0\0\2\0\0\0\xff\xfe", "UTF-8 JSON"),
        (b"KVF1\0\0\0\0\5\0\0\0{}", "truncated"),
    ],
)
def test_parse_rejects_garbage(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_prefix(data)


def test_a_header_nested_too_deeply_is_a_protocol_error() -> None:
    """Found by trying the product: 3,000 ``[`` as a header (any peer, before the
    handshake) raised RecursionError, which the ports logged as a traceback and answered
    with a bare close."""
    header = b"[" * 4000
    with pytest.raises(ProtocolError, match="nested too deeply"):
        parse_prefix(b"KVF1\0\0\0\0" + len(header).to_bytes(4, "little") + header)


def test_parse_fixed_checks_limits_before_allocating() -> None:
    limits = FrameLimits(max_header_bytes=64, max_buffers=2)
    with pytest.raises(ProtocolError, match="3 buffers"):
        parse_fixed(b"KVF1\0\0\3\0\2\0\0\0", limits)
    with pytest.raises(ProtocolError, match="65-byte header"):
        parse_fixed(b"KVF1\0\0\0\0\x41\0\0\0", limits)
    assert parse_fixed(b"KVF1\0\0\2\0\x40\0\0\0", limits) == 16 + 64


def test_frame_limits_validate() -> None:
    for bad in ({"max_buffers": 70_000}, {"max_header_bytes": 0}, {"max_payload_bytes": -1}):
        with pytest.raises(InvalidArgument):
            FrameLimits(**bad)


def test_byte_views() -> None:
    assert as_byte_view(np.zeros((2, 3), dtype=np.float32)).nbytes == 24
    assert as_byte_view(torch.zeros(4, dtype=torch.float16)).nbytes == 8
    assert as_byte_view(np.zeros((0, 3))).nbytes == 0
    with pytest.raises(InvalidArgument, match="contiguous"):
        as_byte_view(np.zeros((4, 4), dtype=np.uint8)[:, 1])
    with pytest.raises(InvalidArgument, match="contiguous"):
        as_byte_view(torch.zeros(4, 4).t())
    with pytest.raises(InvalidArgument, match="read-only"):
        as_byte_view(b"abc", writable=True)
    with pytest.raises(InvalidArgument):
        as_byte_view(12345)
    view = as_byte_view(torch.zeros(4, dtype=torch.uint8), writable=True)
    view[0] = 7


async def test_a_big_send_and_a_big_receive_at_once_both_finish(case: Case) -> None:
    """One task sends a big frame while another receives one on the same connection, and
    the peer answers with its own big frame before it reads: with small socket buffers
    both directions must progress (a tls:// receive once waited for readability while its
    flush of the sender's ciphertext was what blocked, spinning forever)."""
    big = bytearray(16 * MiB)

    async def answer_first(conn: Connection) -> None:
        await conn.send({"op": "big"}, [big], timeout=30)
        await conn.recv(timeout=30)

    small = {"socket_buffer_bytes": 65536} if case.name != "inproc" else {}
    async with (
        serving(case, answer_first, **small) as listener,
        await case.connect(listener.address, timeout=5, **small) as conn,
    ):
        tx = asyncio.create_task(conn.send({"op": "big"}, [big], timeout=30))
        await asyncio.sleep(0.05)
        header, payload = await asyncio.wait_for(conn.recv(timeout=30), 30)
        await asyncio.wait_for(tx, 30)
    assert header["op"] == "big" and sum(len(p) for p in payload) == len(big)


async def test_a_frame_that_arrived_is_served_after_stop(case: Case) -> None:
    """The client pipelines a put and a ping; the listener stops while the handler is busy
    with the put: the ping had arrived, so it is served (a tls:// record already pulled
    off the socket once counted as nothing buffered, and the ping was dropped)."""
    served: list[str] = []

    async def busy(conn: Connection) -> None:
        await conn.recv(timeout=5)
        await asyncio.sleep(0.3)
        header, _ = await conn.recv(timeout=5)
        served.append(header["op"])
        await conn.send({"op": "pong"}, timeout=5)

    listener = listen(case.any_address, busy, **case.listen_options())
    await listener.start()
    conn = await case.connect(listener.address, timeout=5)
    try:
        await conn.send({"op": "put"}, [bytearray(100_000)], timeout=5)
        await conn.send({"op": "ping"}, timeout=5)
        await asyncio.sleep(0.1)
        await listener.stop(grace=2)
        assert served == ["ping"]
    finally:
        await conn.close()

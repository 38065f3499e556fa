"""The ``ucx://`` fast path's NIXL layer, between real processes over real UCX.

Each peer is a separate process (``spawn``) that plays the storage node: it registers a
patterned buffer with a :class:`NixlAgent` running NIXL's progress thread, sends its
metadata and buffer span through a pipe, then answers small commands (hash a range, return
notifications, measure its idle CPU). The test process is the initiator. One healthy peer
serves the whole module; the destructive tests (SIGKILL, SIGSTOP) get a fresh peer each.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest

from kvstore.errors import UnknownScheme
from kvstore.transport.nixl_binding import import_bindings

try:
    nixl_bindings = import_bindings()  # (as kvstore imports it: see there)
except UnknownScheme as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"nixl-cu12 is not installed ({exc})", allow_module_level=True)

import torch

from kvstore.errors import (
    Closed,
    InvalidArgument,
    KVTimeout,
    PeerDisconnected,
    ProtocolError,
    TransportError,
    UnknownScheme,
)
from kvstore.transport import nixl as nixl_module
from kvstore.transport.nixl import INLINE_BYTES, INLINE_SPIN_S, NixlAgent, Span, net_device_for

MiB = 1 << 20
PEER_BYTES = 16 * MiB
LOCAL_BYTES = 16 * MiB
REPLY_S = 20.0


def pattern(nbytes: int) -> np.ndarray:
    """What every peer's buffer holds at start: byte i is i % 251."""
    return (np.arange(nbytes, dtype=np.uint32) % 251).astype(np.uint8)


def _peer_main(conn: Connection, nbytes: int) -> None:
    """A storage-node stand-in: registers a patterned buffer and serves pipe commands."""
    asyncio.run(_peer_serve(conn, nbytes))


async def _peer_serve(conn: Connection, nbytes: int) -> None:
    buf = torch.from_numpy(pattern(nbytes))
    async with NixlAgent(f"peer-{os.getpid()}", progress_thread=True) as agent:
        reg = await agent.register(buf)
        conn.send((await agent.metadata(), reg.span().to_wire(), agent.name))
        loop = asyncio.get_running_loop()
        while True:
            cmd, *args = await loop.run_in_executor(None, conn.recv)
            if cmd == "stop":
                break
            if cmd == "sha":
                start, size = args
                conn.send(hashlib.sha256(buf[start : start + size].numpy().tobytes()).hexdigest())
            elif cmd == "notifs":
                conn.send(await agent.poll_notifs())
            elif cmd == "notify":  # (opens this side's connection to an initiator)
                metadata, message = args
                await agent.notify(await agent.add_peer(metadata), message)
                conn.send("sent")
            elif cmd == "idle_cpu":
                before = time.process_time()
                await asyncio.sleep(args[0])
                conn.send(time.process_time() - before)
    conn.send("stopped")


@dataclass
class Peer:
    """A running peer process, as the initiator sees it."""

    process: Any
    conn: Connection
    metadata: bytes
    span: Span
    name: str

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(REPLY_S):
            raise AssertionError(f"peer did not answer {cmd[0]!r}")
        return self.conn.recv()

    def signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.signal(signal.SIGCONT)
            with contextlib.suppress(OSError, BrokenPipeError):
                self.conn.send(("stop",))
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


@contextlib.contextmanager
def running_peer(nbytes: int = PEER_BYTES) -> Iterator[Peer]:
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    process = ctx.Process(target=_peer_main, args=(there, nbytes), daemon=True)
    process.start()
    there.close()
    try:
        if not here.poll(60):
            raise AssertionError("peer process did not start")
        metadata, wire, name = here.recv()
        peer = Peer(process, here, metadata, Span.from_wire(wire), name)
    except BaseException:
        process.kill()
        raise
    try:
        yield peer
    finally:
        peer.stop()


@dataclass
class Initiator:
    agent: NixlAgent
    buf: torch.Tensor


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    with running_peer() as p:
        yield p


@pytest.fixture(scope="module")
def initiator() -> Iterator[Initiator]:
    """One client agent for the module (nothing in it is bound to an event loop)."""
    agent = NixlAgent("test-initiator")
    buf = torch.zeros(LOCAL_BYTES, dtype=torch.uint8)
    asyncio.run(agent.start())
    asyncio.run(agent.register(buf))
    yield Initiator(agent, buf)
    asyncio.run(agent.close())
    assert agent.pending_releases == 0


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


# ---- data moves, byte-exact --------------------------------------------------------------


async def test_write_then_read_back(peer: Peer, initiator: Initiator) -> None:
    agent, buf = initiator.agent, initiator.buf
    name = await agent.add_peer(peer.metadata)
    assert name == peer.name
    size, offset = 6 * MiB + 123, 4096 + 7
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8)
    buf[:size] = payload
    moved = await agent.write(name, [(peer.span.addr + offset, size)], [buf[:size]], timeout=10)
    assert moved == size
    assert peer.ask("sha", offset, size) == sha(payload)

    buf.zero_()
    back = buf[MiB : MiB + size]
    await agent.read(name, [Span(peer.span.addr + offset, size)], [back], timeout=10)
    assert torch.equal(back, payload)


async def test_read_the_peers_own_bytes(peer: Peer, initiator: Initiator) -> None:
    agent, buf = initiator.agent, initiator.buf
    name = await agent.add_peer(peer.metadata)
    tail = peer.span.nbytes - 8 * MiB  # a range the write test never touches
    await agent.read(name, [(peer.span.addr + tail, 8 * MiB)], [buf[: 8 * MiB]], timeout=10)
    assert np.array_equal(buf[: 8 * MiB].numpy(), pattern(peer.span.nbytes)[tail:])


async def test_many_descriptors_both_ways(peer: Peer, initiator: Initiator) -> None:
    agent, buf = initiator.agent, initiator.buf
    name = await agent.add_peer(peer.metadata)
    n, size, stride = 1024, 4096, 5000  # scattered remote spans, packed local ones
    base = 3 * MiB
    remote = [Span(peer.span.addr + base + i * stride, size) for i in range(n)]
    payload = torch.randint(0, 256, (n * size,), dtype=torch.uint8)
    buf[: n * size] = payload
    local_views = [buf[i * size : (i + 1) * size] for i in range(n)]
    assert await agent.write(name, remote, local_views, timeout=10) == n * size
    for i in (0, 1, n // 2, n - 1):
        assert peer.ask("sha", base + i * stride, size) == sha(payload[i * size : (i + 1) * size])

    buf.zero_()
    local_tuples = [(buf.data_ptr() + 8 * MiB + i * size, size) for i in range(n)]
    assert await agent.read(name, remote, local_tuples, timeout=10) == n * size
    assert torch.equal(buf[8 * MiB : 8 * MiB + n * size], payload)


async def test_concurrent_transfers_interleave(peer: Peer, initiator: Initiator) -> None:
    agent, buf = initiator.agent, initiator.buf
    name = await agent.add_peer(peer.metadata)
    size = MiB
    offsets = [i * 2 * MiB + 11 for i in range(6)]
    reads = [
        agent.read(name, [(peer.span.addr + off, size)], [buf[i * size : (i + 1) * size]])
        for i, off in enumerate(offsets)
    ]
    assert await asyncio.gather(*reads) == [size] * len(offsets)
    for i, off in enumerate(offsets):  # other tests wrote parts: ask the peer what it holds
        assert sha(buf[i * size : (i + 1) * size]) == peer.ask("sha", off, size)


async def test_notifications_reach_the_peer(peer: Peer, initiator: Initiator) -> None:
    agent, buf = initiator.agent, initiator.buf
    name = await agent.add_peer(peer.metadata)
    buf[:4096] = 7
    await agent.write(name, [(peer.span.addr, 4096)], [buf[:4096]], notif=b"landed:\x00\xff")
    await agent.notify(name, b"standalone")
    got: list[bytes] = []
    for _ in range(100):
        got += peer.ask("notifs").get(agent.name, [])
        if len(got) == 2:
            break
        await asyncio.sleep(0.02)
    assert got == [b"landed:\x00\xff", b"standalone"]


# ---- small calls on the loop, large ones on the worker thread ------------------------------


class Recording:
    """A NIXL agent that notes which thread posted each request and which handles were
    created and released (fault-free: every call goes through to the real agent)."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.posted_on: list[str] = []
        self.created: list[int] = []
        self.released: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def createXferReq(self, *args: Any) -> Any:
        handle = self._real.createXferReq(*args)
        self.created.append(handle)
        return handle

    def postXferReq(self, handle: int) -> Any:
        self.posted_on.append(threading.current_thread().name)
        return self._real.postXferReq(handle)

    def releaseXferReq(self, handle: int) -> Any:
        status = self._real.releaseXferReq(handle)
        if status == nixl_bindings.NIXL_SUCCESS:
            self.released.append(handle)
        return status


@contextlib.contextmanager
def recording(agent: NixlAgent) -> Iterator[Recording]:
    real = agent._agent
    rec = agent._agent = Recording(real)
    try:
        yield rec
    finally:
        agent._agent = real


async def test_small_calls_post_on_the_loop_and_large_ones_on_the_worker(
    peer: Peer, initiator: Initiator
) -> None:
    agent, buf = initiator.agent, initiator.buf
    name = await agent.add_peer(peer.metadata)
    small, large = 4096, INLINE_BYTES + 4096
    payload = torch.randint(0, 256, (small + large,), dtype=torch.uint8)
    buf[: small + large] = payload
    with recording(agent) as rec:
        await agent.write(name, [(peer.span.addr, small)], [buf[:small]])
        await agent.write(name, [(peer.span.addr + small, large)], [buf[small : small + large]])
        # several spans count together: 2 x (INLINE_BYTES / 2 + 1) goes to the worker
        half = INLINE_BYTES // 2 + 1
        spans = [(peer.span.addr + 8 * MiB + i * half, half) for i in range(2)]
        await agent.read(name, spans, [buf[8 * MiB + i * half :][:half] for i in range(2)])
    me = threading.current_thread().name
    assert rec.posted_on[0] == me
    assert rec.posted_on[1].startswith(f"nixl-{agent.name}")
    assert rec.posted_on[2].startswith(f"nixl-{agent.name}")
    assert sorted(rec.released) == sorted(rec.created)
    assert peer.ask("sha", 0, small + large) == sha(payload)


async def test_an_agent_alone_posts_calls_up_to_its_cap_on_the_loop(peer: Peer) -> None:
    """With ``alone_inline_bytes``, a call up to it is posted on the loop while no other
    transfer of the agent is in flight, a larger one on the worker, and one made while
    another is in flight on the worker too; every byte lands either way."""
    agent = NixlAgent("test-alone", alone_inline_bytes=4 * MiB)
    buf = torch.randint(0, 256, (LOCAL_BYTES,), dtype=torch.uint8)
    async with agent:
        await agent.register(buf)
        name = await agent.add_peer(peer.metadata)
        me = threading.current_thread().name
        with recording(agent) as rec:
            await agent.write(name, [(peer.span.addr, 3 * MiB)], [buf[: 3 * MiB]])
            await agent.write(name, [(peer.span.addr, 5 * MiB)], [buf[: 5 * MiB]])
            # Another transfer in flight (one that has not completed: RDMA, TCP): held
            # there, in the agent's books, for the length of the next call.
            other = nixl_module._Transfer("WRITE", name, time.monotonic() + 60)
            agent._live.add(other)
            try:
                await agent.write(name, [(peer.span.addr + 5 * MiB, 2 * MiB)],
                                  [buf[5 * MiB : 7 * MiB]])  # fmt: skip
            finally:
                agent._live.discard(other)
            await agent.write(name, [(peer.span.addr + 7 * MiB, 2 * MiB)],
                              [buf[7 * MiB : 9 * MiB]])  # fmt: skip
        assert rec.posted_on[0] == me
        assert rec.posted_on[1].startswith(f"nixl-{agent.name}")
        assert rec.posted_on[2].startswith(f"nixl-{agent.name}"), "another one is in flight"
        assert rec.posted_on[3] == me
    assert peer.ask("sha", 0, 9 * MiB) == sha(buf[: 9 * MiB])


async def test_inline_and_threaded_transfers_interleave(peer: Peer, initiator: Initiator) -> None:
    agent, buf = initiator.agent, initiator.buf
    name = await agent.add_peer(peer.metadata)
    sizes = [64, 4096, INLINE_BYTES, 2 * INLINE_BYTES, 96 * 1024, 3 * INLINE_BYTES // 2, 1000]
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += size + 4096
    assert at <= LOCAL_BYTES // 2
    payload = torch.randint(0, 256, (at,), dtype=torch.uint8)
    buf[:at] = payload
    with recording(agent) as rec:
        for _ in range(3):  # writes of every size at once, then reads of them, at once
            writes = [
                agent.write(name, [(peer.span.addr + off, n)], [buf[off : off + n]])
                for off, n in zip(offsets, sizes, strict=True)
            ]
            assert await asyncio.gather(*writes) == sizes
            back = LOCAL_BYTES // 2
            buf[back:] = 0
            reads = [
                agent.read(name, [(peer.span.addr + off, n)], [buf[back + off : back + off + n]])
                for off, n in zip(offsets, sizes, strict=True)
            ]
            assert await asyncio.gather(*reads) == sizes
            for off, n in zip(offsets, sizes, strict=True):
                assert torch.equal(buf[back + off : back + off + n], payload[off : off + n])
    me = threading.current_thread().name
    assert me in rec.posted_on
    assert any(t.startswith("nixl-") for t in rec.posted_on)
    assert sorted(rec.released) == sorted(rec.created)
    assert agent.pending_releases == 0


async def test_inline_transfer_past_its_deadline_is_released(initiator: Initiator) -> None:
    # A stopped target cannot answer the connection handshake: the post on the loop
    # returns in flight, and the call must end at its deadline with every handle released,
    # both when the deadline falls inside the spin on the loop and when it falls later,
    # on the worker thread.
    agent, buf = initiator.agent, initiator.buf
    with running_peer(MiB) as frozen:
        name = await agent.add_peer(frozen.metadata)
        frozen.signal(signal.SIGSTOP)
        with recording(agent) as rec:
            for timeout in (INLINE_SPIN_S / 4, 0.3):
                with pytest.raises(KVTimeout):
                    await agent.read(name, [(frozen.span.addr, 64)], [buf[:64]], timeout=timeout)
                assert agent.pending_releases == 0
            # and a refused release is parked, then retried before the next post
            real = rec._real
            rec._real = RefusesOneRelease(real)
            try:
                with pytest.raises(KVTimeout):
                    await agent.read(name, [(frozen.span.addr, 64)], [buf[:64]], timeout=0.01)
                assert agent.pending_releases == 1
            finally:
                rec._real = real
            frozen.signal(signal.SIGCONT)
            buf[:4096] = 0
            await agent.read(name, [(frozen.span.addr, 4096)], [buf[:4096]], timeout=10)
            assert np.array_equal(buf[:4096].numpy(), pattern(4096))
            assert agent.pending_releases == 0
        assert rec.posted_on[0] == threading.current_thread().name
        assert sorted(rec.released) == sorted(rec.created)
        await agent.remove_peer(name)


async def test_peer_killed_during_small_inline_transfers(initiator: Initiator) -> None:
    agent, buf = initiator.agent, initiator.buf
    with running_peer(MiB) as doomed:
        name = await agent.add_peer(doomed.metadata)
        small = [(doomed.span.addr, 4096)]
        await agent.write(name, small, [buf[:4096]], timeout=10)  # connected and warm
        killer = threading.Timer(0.05, doomed.signal, (signal.SIGKILL,))
        started = time.monotonic()
        killer.start()
        try:
            with pytest.raises(PeerDisconnected):
                while time.monotonic() - started < 20:
                    await agent.write(name, small, [buf[:4096]], timeout=10)
                    await agent.read(name, small, [buf[4096:8192]], timeout=10)
                    await asyncio.sleep(0)
        finally:
            killer.join()
        with pytest.raises(PeerDisconnected):  # fails fast from now on, never hangs
            await agent.read(name, small, [buf[:4096]], timeout=10)
        await agent.remove_peer(name)
    assert agent.pending_releases == 0


async def test_cancelled_transfer_on_the_worker_is_released(initiator: Initiator) -> None:
    agent, buf = initiator.agent, initiator.buf
    big = INLINE_BYTES + 4096
    with running_peer(2 * big) as frozen:
        name = await agent.add_peer(frozen.metadata)
        frozen.signal(signal.SIGSTOP)
        with recording(agent) as rec:
            task = asyncio.create_task(
                agent.read(name, [(frozen.span.addr, big)], [buf[:big]], timeout=30)
            )
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await agent.metadata()  # after the release, on the (FIFO) worker thread
        assert rec.posted_on[0].startswith(f"nixl-{agent.name}")
        assert rec.created and sorted(rec.released) == sorted(rec.created)
        assert agent.pending_releases == 0
        await agent.remove_peer(name)


# ---- bad calls ---------------------------------------------------------------------------


async def test_bad_calls_raise_typed_errors(peer: Peer, initiator: Initiator) -> None:
    agent, buf = initiator.agent, initiator.buf
    name = await agent.add_peer(peer.metadata)
    remote = [peer.span.addr, 4096]
    with pytest.raises(InvalidArgument, match="remote spans but"):
        await agent.read(name, [remote, remote], [buf[:4096]])
    with pytest.raises(InvalidArgument, match="lengths differ"):
        await agent.read(name, [remote], [buf[:100]])
    with pytest.raises(InvalidArgument, match="not inside memory this agent registered"):
        await agent.read(name, [remote], [torch.zeros(4096, dtype=torch.uint8)])
    with pytest.raises(InvalidArgument, match="unknown NIXL peer"):
        await agent.read("nobody", [remote], [buf[:4096]])
    with pytest.raises(InvalidArgument, match="timeout"):
        await agent.read(name, [remote], [buf[:4096]], timeout=0)
    outside = (peer.span.addr + peer.span.nbytes - 10, 4096)
    with pytest.raises(ProtocolError, match="not inside memory the peer registered"):
        await agent.read(name, [outside], [buf[:4096]])
    with pytest.raises(ProtocolError):
        await agent.add_peer(b"not nixl metadata")
    assert await agent.read(name, [], []) == 0
    # the agent is still fine afterwards
    await agent.read(name, [remote], [buf[:4096]])
    assert sha(buf[:4096]) == peer.ask("sha", 0, 4096)


def test_span_wire_format() -> None:
    span = Span(0x7F00_0000_1000, 4096, 1, "VRAM")
    assert span.to_wire() == [0x7F00_0000_1000, 4096, 1, 1]
    assert Span.from_wire(span.to_wire()) == span
    assert Span.from_wire([10, 20, 0]) == Span(10, 20, 0, "DRAM")
    assert Span.from_wire((10, 20)) == Span(10, 20)
    for bad in (
        [1],
        [1, -2, 0],
        [1, 2, 0, 7],
        [1, 2, 0, "HBM"],
        "x",
        [1.0, 2, 0],
        [0, 5, 0],
        [1, 0, 0],
    ):
        with pytest.raises(ProtocolError):
            Span.from_wire(bad)


async def test_registration_spans_and_deregister() -> None:
    async with NixlAgent("test-reg") as agent:
        t = torch.zeros(10_000, dtype=torch.uint8)
        reg = await agent.register(t)
        assert (reg.addr, reg.nbytes, reg.mem, reg.dev_id) == (t.data_ptr(), 10_000, "DRAM", 0)
        assert reg.span(100, 50) == Span(t.data_ptr() + 100, 50, 0, "DRAM")
        assert reg.span(9_000).nbytes == 1_000
        for offset, n in ((9_999, 2), (-1, 1), (0, 0)):
            with pytest.raises(InvalidArgument):
                reg.span(offset, n)
        with pytest.raises(InvalidArgument, match="contiguous"):
            await agent.register(torch.zeros(4, 4, dtype=torch.uint8).t())
        assert len(await agent.metadata()) > 0
        assert await agent.deregister(reg) is True
        assert await agent.deregister(reg) is False


# ---- failures: killed, frozen, closed ----------------------------------------------------


async def test_peer_killed_mid_transfer_raises_peer_disconnected(initiator: Initiator) -> None:
    agent, buf = initiator.agent, initiator.buf
    with running_peer() as doomed:
        name = await agent.add_peer(doomed.metadata)
        whole = [(doomed.span.addr, LOCAL_BYTES)]
        await agent.read(name, whole, [buf], timeout=10)  # connected and warm
        killer = threading.Timer(0.05, doomed.signal, (signal.SIGKILL,))
        killer.start()
        try:
            with pytest.raises(PeerDisconnected):
                for _ in range(2000):  # ~10 ms each; the kill lands in one of them
                    await agent.read(name, whole, [buf], timeout=10)
        finally:
            killer.join()
        with pytest.raises(PeerDisconnected):  # fails fast from now on, never hangs
            await agent.write(name, whole, [buf], timeout=10)
        assert await agent.remove_peer(name) is True
        assert await agent.remove_peer(name) is False
    assert agent.pending_releases == 0


async def test_peer_killed_before_connecting_raises_peer_disconnected(
    initiator: Initiator,
) -> None:
    agent, buf = initiator.agent, initiator.buf
    with running_peer(MiB) as doomed:
        name = await agent.add_peer(doomed.metadata)
        doomed.signal(signal.SIGKILL)
        doomed.process.join(10)
        with pytest.raises(PeerDisconnected):
            await agent.read(name, [(doomed.span.addr, MiB)], [buf[:MiB]], timeout=10)
        await agent.remove_peer(name)


async def test_frozen_peer_times_out_then_recovers(initiator: Initiator) -> None:
    # A stopped target cannot answer UCX's connection handshake, so the first transfer
    # stays in flight (once connected, CMA would not need the target at all).
    agent, buf = initiator.agent, initiator.buf
    with running_peer(MiB) as frozen:
        name = await agent.add_peer(frozen.metadata)
        frozen.signal(signal.SIGSTOP)
        with pytest.raises(KVTimeout):
            await agent.read(name, [(frozen.span.addr, MiB)], [buf[:MiB]], timeout=0.3)
        assert agent.pending_releases == 0  # NIXL cancelled the in-flight transfer

        # NIXL has always accepted the release here; make it refuse once (fault injection
        # at the foreign boundary) to see the handle parked and released later.
        real = agent._agent
        agent._agent = RefusesOneRelease(real)
        try:
            with pytest.raises(KVTimeout):
                await agent.read(name, [(frozen.span.addr, MiB)], [buf[:MiB]], timeout=0.3)
            assert agent.pending_releases == 1
        finally:
            agent._agent = real
        frozen.signal(signal.SIGCONT)
        buf[:MiB] = 0
        await agent.read(name, [(frozen.span.addr, MiB)], [buf[:MiB]], timeout=10)
        assert np.array_equal(buf[:MiB].numpy(), pattern(MiB))
        assert agent.pending_releases == 0  # retried before that post
        await agent.remove_peer(name)


class RefusesOneRelease:
    """A NIXL agent whose first ``releaseXferReq`` answers "still active"."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._refuse = 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def releaseXferReq(self, handle: int) -> Any:
        if self._refuse:
            self._refuse -= 1
            return nixl_bindings.NIXL_ERR_REPOST_ACTIVE
        return self._real.releaseXferReq(handle)


async def test_cancelled_transfer_is_released(initiator: Initiator) -> None:
    agent, buf = initiator.agent, initiator.buf
    with running_peer(MiB) as frozen:
        name = await agent.add_peer(frozen.metadata)
        frozen.signal(signal.SIGSTOP)
        task = asyncio.create_task(
            agent.read(name, [(frozen.span.addr, MiB)], [buf[:MiB]], timeout=30)
        )
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await agent.metadata()  # runs after the release on the (FIFO) worker thread
        assert agent.pending_releases == 0
        await agent.remove_peer(name)


async def test_close_is_bounded_idempotent_and_final() -> None:
    agent = NixlAgent("test-close")
    await agent.close()  # never started: fine
    agent = NixlAgent("test-close")
    buf = torch.zeros(MiB, dtype=torch.uint8)
    with running_peer(MiB) as frozen:
        await agent.start()
        await agent.register(buf)
        name = await agent.add_peer(frozen.metadata)
        frozen.signal(signal.SIGSTOP)
        pending = asyncio.create_task(
            agent.read(name, [(frozen.span.addr, MiB)], [buf], timeout=60)
        )
        await asyncio.sleep(0.2)
        await asyncio.wait_for(agent.close(timeout=5), 10)
        with pytest.raises(Closed):
            await asyncio.wait_for(pending, 10)
        await agent.close()
        for call in (agent.metadata(), agent.register(buf), agent.add_peer(frozen.metadata)):
            with pytest.raises(Closed):
                await call
        with pytest.raises(Closed):
            await agent.start()
    for _ in range(100):  # the worker thread exits right after the teardown job
        if not any(t.name.startswith("nixl-test-close") for t in threading.enumerate()):
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the NIXL worker thread outlived close()")


# ---- idle cost, environment, import --------------------------------------------------------


async def test_idle_agents_do_not_spin(peer: Peer, initiator: Initiator) -> None:
    name = await initiator.agent.add_peer(peer.metadata)
    await initiator.agent.read(name, [(peer.span.addr, 4096)], [initiator.buf[:4096]])
    peer.conn.send(("idle_cpu", 2.0))  # the target: progress thread, registered memory
    before = time.process_time()
    await asyncio.sleep(2.0)  # the initiator, in this process, at the same time
    initiator_cpu = (time.process_time() - before) / 2.0
    assert peer.conn.poll(REPLY_S)
    target_cpu = peer.conn.recv() / 2.0
    print(f"idle CPU (cores): target {target_cpu:.4f}, initiator {initiator_cpu:.4f}")
    assert target_cpu < 0.15
    assert initiator_cpu < 0.15


async def test_a_peer_does_not_spin_while_an_initiator_idles() -> None:
    """A target whose UCX opened its side of a connection to an initiator waits for the
    initiator's acknowledgement with the socket armed for writing, and its progress thread
    spun a core for as long as the initiator made no progress (0.5 s of CPU every 0.5 s
    here; a node did it for as long as a client stayed idle). An initiator progresses its
    worker while idle (IDLE_PROGRESS_S), so the wait ends at once and the notification that
    opened it is delivered."""
    with running_peer() as peer:
        async with NixlAgent("test-idle-initiator") as agent:
            await agent.add_peer(peer.metadata)
            assert peer.ask("notify", await agent.metadata(), b"hello") == "sent"
            await asyncio.sleep(0.5)  # (the peer's wait, if any, ends within this)
            target_cpu = peer.ask("idle_cpu", 1.0)
            print(f"target CPU over 1 s, the initiator idle: {target_cpu:.3f} s")
            assert target_cpu < 0.15
            assert await agent.poll_notifs() == {peer.name: [b"hello"]}
            assert await agent.poll_notifs() == {}


def test_net_device_for() -> None:
    assert net_device_for("127.0.0.1") == "lo"
    assert net_device_for("127.0.0.53") == "lo"
    assert net_device_for("localhost") == "lo"
    assert net_device_for(None) is None
    assert net_device_for("0.0.0.0") is None
    with pytest.raises(InvalidArgument):
        net_device_for("203.0.113.254")  # TEST-NET-3: nobody here owns it
    with pytest.raises(InvalidArgument):
        net_device_for("no-such-host.invalid")


def test_net_device_for_a_real_interface() -> None:
    import socket

    pairs = []
    for _, iface in socket.if_nameindex():
        out = subprocess.run(
            ["ip", "-4", "-o", "addr", "show", "dev", iface], capture_output=True, text=True
        )
        for line in out.stdout.splitlines():
            pairs.append((iface, line.split()[3].split("/")[0]))
    pairs = [(i, a) for i, a in pairs if not a.startswith("127.")]
    if not pairs:
        pytest.skip("no non-loopback IPv4 interface (or no `ip`)")
    iface, addr = pairs[0]
    assert net_device_for(addr) == iface


def test_importing_the_module_does_not_import_nixl() -> None:
    code = "import sys, kvstore.transport.nixl; print('nixl_cu12' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


_ENDS_BY_ITSELF = """
import asyncio, torch
from kvclient.ucx import nixl_available
from kvstore.transport.nixl import NixlAgent

async def main():
    assert nixl_available()
    target = NixlAgent("end-target", progress_thread=True)
    async with target, NixlAgent("end-writer") as writer:
        dst, src = torch.zeros(4096, dtype=torch.uint8), torch.full((4096,), 7, dtype=torch.uint8)
        span = (await target.register(dst)).span()
        await writer.register(src)
        peer = await writer.add_peer(await target.metadata())
        assert await writer.write(peer, [span], [src], timeout=10) == 4096
        assert bool((dst == 7).all())
    print("written")

asyncio.run(main())
"""


def test_a_process_that_used_ucx_ends_by_itself_with_status_0() -> None:
    """An engine that embeds kvclient ends through Python's own exit, C destructors and all:
    on a host with the system's RDMA providers (CI installs them) the wheel's and the
    system's libnl-route-3 crashed it with SIGSEGV there (nixl_binding says why)."""
    out = subprocess.run(
        [sys.executable, "-c", _ENDS_BY_ITSELF], capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "written", out.stderr[-2000:]
    assert out.returncode == 0, f"status {out.returncode}: {out.stderr[-2000:]}"


def test_missing_nixl_is_an_unknown_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl_cu12", None)
    monkeypatch.setitem(sys.modules, "nixl_cu12._bindings", None)
    with pytest.raises(UnknownScheme, match="ucx:// needs nixl-cu12"):
        NixlAgent("nope")


def test_bad_constructor_arguments() -> None:
    with pytest.raises(InvalidArgument):
        NixlAgent("")
    with pytest.raises(InvalidArgument):
        NixlAgent("x", progress_delay_us=0)


async def test_failed_start_is_a_transport_error_and_close_still_works() -> None:
    before = os.environ.get("UCX_NET_DEVICES")
    agent = NixlAgent("test-bad-start", net_devices="no-such-nic0")
    with pytest.raises(TransportError):
        await agent.start()
    # The agent's choice of devices never leaks into the environment of child processes.
    assert os.environ.get("UCX_NET_DEVICES") == before
    await agent.close()
    await agent.close()
    with pytest.raises(Closed):
        await agent.metadata()


async def test_unstarted_agent_says_so() -> None:
    agent = NixlAgent("never-started")
    with pytest.raises(InvalidArgument, match="start"):
        await agent.metadata()

"""The ``tcp://host:port`` backend: frames over a plain TCP socket on asyncio.

Zero-copy where it counts. A frame is written with one ``sendmsg`` gather of the prefix and
the caller's buffers (more calls only when the socket buffer fills). Receiving goes through a
small per-connection staging buffer (64 KiB) only for prefixes and the tail of a read: a
payload view is filled by ``recvmsg_into([view, staging])``, so the kernel copies the bytes
straight into the caller's memory (e.g. a storage slot) and whatever follows the payload
(the next frame's prefix) lands in staging in the same system call. No ``readexactly``, no
intermediate ``bytes``: a payload is copied once, kernel to destination, except for the few
bytes that arrived in staging together with the prefix.

The socket is driven directly with ``add_reader``/``add_writer`` rather than through
``loop.sock_recv_into``: waiting for readiness is then the only cancellable step, so a
timeout never loses bytes the kernel already handed over and a header wait can resume.

Every socket gets TCP_NODELAY (control frames are small and latency-bound). Socket buffers
are left to Linux's autotuning by default: pinning SO_SNDBUF/SO_RCVBUF to 4 MiB (the
``socket_buffer_bytes`` option) measured no faster on loopback for 512 KiB and 4 MiB puts,
often slower — an explicit SO_RCVBUF turns receive autotuning off.

Memory per connection: the 64 KiB staging buffer, grown for a prefix only as its bytes
arrive (doubling, so at most twice the bytes received) and given back after it, never to
the header length a prefix announces: 100 connections that each announce a ~500 KB header
and send 12 bytes cost a node 6 MiB (their staging), not the 55 MiB an up-front allocation
did (docs/decisions.md). A listener fits ``max_connections`` under the process's file
descriptor limit: it raises the soft ``RLIMIT_NOFILE`` toward the hard one when the bound
needs it, and lowers the bound (with a warning) when even that is too small, so that the
bound, not ``EMFILE``, is what refuses a client.
"""

from __future__ import annotations

import asyncio
import functools
import os
import resource
import socket
import urllib.parse
from collections.abc import Callable
from typing import Any

from kvstore.errors import (
    InvalidArgument,
    KVStoreError,
    PeerDisconnected,
    TransportError,
    Unreachable,
)
from kvstore.transport.base import (
    DEFAULT_MAX_CONNECTIONS,
    MAX_REFUSING,
    PROGRESS_BYTES,
    Backend,
    Connection,
    Handler,
    Listener,
    Refusal,
    logger,
    with_timeout,
)
from kvstore.transport.framing import (
    DEFAULT_LIMITS,
    FIXED_SIZE,
    Frame,
    FrameLimits,
    parse_fixed,
    parse_rest,
)

__all__ = [
    "BACKEND",
    "DEFAULT_SOCKET_BUFFER_BYTES",
    "FD_HEADROOM",
    "TcpBackend",
    "TcpConnection",
    "TcpListener",
    "fit_fd_limit",
]

DEFAULT_SOCKET_BUFFER_BYTES: int | None = None
"""SO_SNDBUF/SO_RCVBUF to request; ``None`` keeps Linux's autotuning (see the module notes)."""

FD_HEADROOM = 256
"""File descriptors a listening process keeps free beyond those open when the listener
starts, its ``max_connections`` and its :data:`~kvstore.transport.base.MAX_REFUSING`
refusals: the gRPC channels, the metrics server and its scrapes, UCX endpoints, log files.
Measured: ``kvstore serve`` has 19 open once ready, 1043 with its 1024 connections."""

_STAGE_BYTES = 64 * 1024
_LOWAT_BYTES = 512 * 1024
"""Most payload bytes a receive waits to have queued before the loop wakes it (see
:meth:`TcpConnection._lowat`)."""
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16
_BACKLOG = 512
"""Kernel accept queue, independent of ``max_connections``: the accept loop drains it at
once and refuses (or makes room for) what exceeds the bound; a queue as short as a small
bound would drop a burst's SYNs instead, and those clients retry a second later."""


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class TcpConnection(Connection):
    """A :class:`~kvstore.transport.base.Connection` over one connected TCP socket."""

    _LOWAT = True
    """Whether waits may ask for more than one byte; off over TLS, where a wait's bytes are
    ciphertext and a record begun in the TLS object's buffer would leave a mark unmet."""

    def __init__(
        self, sock: socket.socket, *, peer: str, limits: FrameLimits = DEFAULT_LIMITS
    ) -> None:
        super().__init__(peer=peer, limits=limits)
        sock.setblocking(False)
        self._sock: socket.socket | None = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._stage = bytearray(_STAGE_BYTES)
        self._stage_mv = memoryview(self._stage)
        self._start = 0
        self._end = 0
        self._waiters: dict[bool, asyncio.Future[None]] = {}
        self._lowat_now = 1

    # -- sending ----------------------------------------------------------------------------

    async def _write_frame(self, prefix: bytes, views: list[memoryview]) -> None:
        await self._write_rest([memoryview(prefix), *(v for v in views if v.nbytes)])

    def _write_now(self, iov: list[memoryview]) -> list[memoryview]:
        while iov:
            sock = self._live()
            try:
                sent = sock.sendmsg(iov[:_IOV_MAX])
            except (BlockingIOError, InterruptedError):
                return iov
            except OSError as exc:
                raise self._translate(exc, "send") from exc
            iov = _advance(iov, sent)
        return iov

    async def _write_rest(self, iov: list[memoryview]) -> None:
        while iov:
            sock = self._live()
            try:
                sent = sock.sendmsg(iov[:_IOV_MAX])
            except (BlockingIOError, InterruptedError):
                await self._wait_io(write=True)
                continue
            except OSError as exc:
                raise self._translate(exc, "send") from exc
            iov = _advance(iov, sent)

    # -- receiving ----------------------------------------------------------------------------

    async def _await_frame(self) -> None:
        if self._end > self._start:
            return
        self._start = self._end = 0  # staging is empty: receive at its front
        self._end = await self._recv(self._recv_to_stage, payload=False)

    async def _read_prefix(self) -> tuple[Frame, int]:
        fixed = await self._staged(FIXED_SIZE)
        total = FIXED_SIZE + parse_fixed(fixed, self.limits)
        data = await self._staged(total)
        frame = parse_rest(data[:FIXED_SIZE], data[FIXED_SIZE:], self.limits)
        self._start += total
        if len(self._stage) > _STAGE_BYTES and self._end - self._start <= _STAGE_BYTES:
            self._restage(_STAGE_BYTES)  # a large header grew staging: give the memory back
        return frame, total

    async def _read_payload(
        self,
        targets: list[memoryview | None],
        sizes: list[int],
        on_progress: Callable[[int, int], None] | None,
    ) -> None:
        for i, (target, size) in enumerate(zip(targets, sizes, strict=True)):
            if self._end - self._start >= size and on_progress is None:
                # Staged whole (small buffers arrive with their prefix): a copy or a skip,
                # without a coroutine per buffer (~3 µs each, per chunk of a put).
                if target is None:
                    self._start += size
                else:
                    self._take(target)
            elif target is None:
                await self._skip(size)
            elif on_progress is None:
                await self._fill(target)
            else:
                await self._fill(target, functools.partial(on_progress, i))

    def _buffered(self) -> int:
        staged = self._end - self._start
        if staged or self._sock is None:
            return staged
        try:
            return len(self._sock.recv(1, socket.MSG_PEEK))
        except OSError:  # nothing to read (BlockingIOError) or a broken socket
            return 0

    def _quiet(self) -> bool:
        if self._sock is None or self._end > self._start:
            return False
        try:
            self._sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return True  # nothing to read and no EOF: the peer is still there
        except OSError:
            return False  # reset or otherwise broken
        return False  # EOF (b"") or bytes nobody asked for

    async def _staged(self, n: int) -> memoryview:
        """Ensure ``n`` unread bytes in staging; return a view of them (not consumed).

        Staging grows only when it is full of unread bytes, and then at most doubles: what
        a prefix costs follows the bytes that arrived, never the ``n`` it announced.
        """
        while self._end - self._start < n:
            if self._end == len(self._stage):
                unread = self._end - self._start
                grow = unread == len(self._stage)
                self._restage(min(n, 2 * len(self._stage)) if grow else len(self._stage))
            self._end += await self._recv(self._recv_to_stage, payload=False)
        return self._stage_mv[self._start : self._start + n]

    async def _fill(self, view: memoryview, progress: Callable[[int], None] | None = None) -> None:
        """Fill ``view``: staged bytes first, then straight from the kernel; with
        ``progress``, in pieces of at most :data:`PROGRESS_BYTES`, reporting each.

        :meth:`_recv`'s loop, inlined: a payload is tens of receives (32 for 4 MiB in
        pieces), and a coroutine and a bound call per receive measured ~4 µs each here."""
        size = len(view)
        pos = self._take(view)
        if progress is not None and (pos or not size):
            progress(pos)
        step = size if progress is None else PROGRESS_BYTES
        while pos < size:
            self._start = self._end = 0  # staging is empty here: _take drained it
            end = min(pos + step, size)
            sock = self._live()
            try:
                if end < size:  # short of the view's end: nothing spills
                    got = sock.recv_into(view[pos:end])
                else:  # the payload's end: what follows it spills into staging
                    got = int(sock.recvmsg_into([view[pos:end], self._stage_mv])[0])
            except (BlockingIOError, InterruptedError):
                self._lowat(sock, size - pos)
                await self._wait_io(write=False)
                continue
            except OSError as exc:
                raise self._translate(exc, "recv") from exc
            if got == 0:
                raise PeerDisconnected(f"{self.peer} closed the connection (mid-frame)")
            into = min(got, size - pos)
            self._end = got - into
            pos += into
            if progress is not None:
                progress(pos)

    async def _skip(self, size: int) -> None:
        """Consume and drop ``size`` payload bytes."""
        remaining = size
        while True:
            dropped = min(remaining, self._end - self._start)
            self._start += dropped
            remaining -= dropped
            if not remaining:
                return
            self._start = self._end = 0
            self._end = await self._recv(self._recv_all_stage, payload=True)

    def _take(self, view: memoryview) -> int:
        count = min(len(view), self._end - self._start)
        if count:
            view[:count] = self._stage_mv[self._start : self._start + count]
            self._start += count
        return count

    def _restage(self, capacity: int) -> None:
        """Move the unread bytes to the front of a staging buffer of ``capacity`` bytes."""
        unread = self._stage[self._start : self._end]
        if capacity != len(self._stage):
            self._stage = bytearray(capacity)
            self._stage_mv = memoryview(self._stage)
        self._stage_mv[: len(unread)] = unread
        self._start, self._end = 0, len(unread)

    def _recv_to_stage(self, sock: socket.socket) -> int:
        return sock.recv_into(self._stage_mv[self._end :])

    def _recv_all_stage(self, sock: socket.socket) -> int:
        return sock.recv_into(self._stage_mv)

    async def _recv(
        self, call: Callable[[socket.socket], int], *, payload: bool, want: int = 1
    ) -> int:
        """Run a non-blocking receive ``call`` until it returns bytes; 0 bytes is EOF.
        ``want``: bytes the stream is sure to bring next (the rest of a payload view), so
        that a wait can ask for up to that many (:meth:`_lowat`)."""
        while True:
            sock = self._live()
            try:
                got = call(sock)
            except (BlockingIOError, InterruptedError):
                self._lowat(sock, want)
                await self._wait_io(write=False)
                continue
            except OSError as exc:
                raise self._translate(exc, "recv") from exc
            if got == 0:
                mid = "mid-frame" if payload or self._end > self._start else "between frames"
                raise PeerDisconnected(f"{self.peer} closed the connection ({mid})")
            return got

    def _lowat(self, sock: socket.socket, want: int) -> None:
        """Have the socket report readable only once ``min(want, 512 KiB)`` bytes are
        queued (``SO_RCVLOWAT``; 1 for every wait but a payload's). A payload otherwise
        wakes the loop for each segment the sender's kernel hands over, and each wake-up
        costs a loop turn and a reader registration (docs/decisions.md). ``want`` never
        exceeds what the frame still owes, so an honest peer always brings it; a stalled
        one meets the receive's timeout as before. The mark is also kept to a quarter of
        the socket's receive buffer, which the sender can always fill: a kernel older than
        4.18, or a buffer pinned by ``socket_buffer_bytes``, does not grow the buffer to
        fit a mark, and a mark it cannot meet would stall the payload until its timeout.
        System calls: one to read the buffer at each payload wait, one to set the mark
        when it changes."""
        try:
            target = 1
            if want > 1 and self._LOWAT:
                room = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4
                target = max(1, min(want, _LOWAT_BYTES, room))
            if target != self._lowat_now:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, target)
                self._lowat_now = target
        except OSError:  # not supported here: every wait then wakes for any byte
            self._LOWAT = False

    # -- readiness and teardown -------------------------------------------------------------

    def _live(self) -> socket.socket:
        if self._sock is None:
            self._raise_if_closed()
            raise TransportError(f"{self.peer}: socket already released")
        return self._sock

    async def _wait_io(self, *, write: bool) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        if write:
            self._loop.add_writer(self._fd, _wake, fut)
        else:
            self._loop.add_reader(self._fd, _wake, fut)
        self._waiters[write] = fut
        try:
            await fut
        finally:
            self._waiters.pop(write, None)
            if self._sock is not None:  # after _abort the fd may already be reused
                if write:
                    self._loop.remove_writer(self._fd)
                else:
                    self._loop.remove_reader(self._fd)

    def _abort(self, exc: KVStoreError) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
            self._loop.remove_writer(self._fd)
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(exc)
        self._waiters.clear()
        sock.close()

    def _translate(self, exc: OSError, op: str) -> KVStoreError:
        if isinstance(exc, ConnectionError):
            return PeerDisconnected(f"{op} on {self.peer}: {exc}")
        return TransportError(f"{op} on {self.peer} failed: {exc}")


def _advance(iov: list[memoryview], sent: int) -> list[memoryview]:
    """Drop the first ``sent`` bytes from a gather list."""
    i = 0
    while i < len(iov) and sent >= iov[i].nbytes:
        sent -= iov[i].nbytes
        i += 1
    rest = iov[i:]
    if sent and rest:
        rest[0] = rest[0][sent:]
    return rest


class TcpListener(Listener):
    """A :class:`~kvstore.transport.base.Listener` on a TCP port (port 0: any free one)."""

    def __init__(
        self,
        uri: str,
        handler: Handler,
        *,
        limits: FrameLimits = DEFAULT_LIMITS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_timeout: float | None = None,
        header_timeout: float | None = None,
        refusal: Refusal | None = None,
        socket_buffer_bytes: int | None = DEFAULT_SOCKET_BUFFER_BYTES,
        scheme: str = "tcp",
    ) -> None:
        super().__init__(
            handler,
            limits=limits,
            max_connections=max_connections,
            idle_timeout=idle_timeout,
            header_timeout=header_timeout,
            refusal=refusal,
        )
        self._scheme = scheme
        self._host, self._port = parse_tcp_uri(uri, listening=True, scheme=scheme)
        self._uri = uri
        self._buffer_bytes = socket_buffer_bytes
        self._sock: socket.socket | None = None
        self._address = ""
        self._accept_task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """``tcp://host:port`` as bound (the real port when asked for port 0)."""
        if not self._address:
            raise InvalidArgument(f"listener for {self._uri} is not started")
        return self._address

    async def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        fits = fit_fd_limit(self.max_connections)
        if fits < self.max_connections:
            logger.warning(
                "%s: serving at most %d connections, not %d: the file descriptor limit "
                "(ulimit -n) is %d",
                self._uri,
                fits,
                self.max_connections,
                resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            )
            self.max_connections = fits
        try:
            infos = await loop.getaddrinfo(
                self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            family, kind, proto, _, addr = infos[0]
            sock = socket.socket(family, kind, proto)
        except OSError as exc:
            raise TransportError(f"cannot listen on {self._uri}: {exc}") from exc
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _tune(sock, self._buffer_bytes)
            sock.bind(addr)
            sock.listen(_BACKLOG)  # not the bound: a burst is refused with a frame, not dropped
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen on {self._uri}: {exc}") from exc
        self._sock = sock
        self._address = _format_address(sock.getsockname(), self._scheme)
        self._accept_task = loop.create_task(self._accept_loop(sock), name=f"accept {self._uri}")

    async def _unbind(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn_sock, addr = await loop.sock_accept(sock)
            except OSError as exc:  # EMFILE and friends: back off instead of spinning
                logger.warning("accept on %s failed: %s", self._address, exc)
                await asyncio.sleep(0.1)
                continue
            try:
                _tune(conn_sock, self._buffer_bytes)
                conn = self._wrap(conn_sock, _format_address(addr, self._scheme))
            except OSError as exc:
                logger.warning("dropping connection from %s: %s", addr, exc)
                conn_sock.close()
                continue
            self._accepted(conn)

    def _wrap(self, sock: socket.socket, peer: str) -> TcpConnection:
        """The connection an accepted socket becomes (``tls://`` wraps it in TLS)."""
        return TcpConnection(sock, peer=peer, limits=self.limits)


def parse_tcp_uri(uri: str, *, listening: bool = False, scheme: str = "tcp") -> tuple[str, int]:
    """Split ``tcp://host:port`` (``[v6]`` hosts allowed; ``scheme``: ``tls`` for
    ``tls://``); port 0 only when ``listening``.

    Raises :class:`~kvstore.errors.InvalidArgument` for anything else.
    """
    try:
        parts = urllib.parse.urlsplit(uri)
        port = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"bad tcp address {uri!r}: {exc}") from exc
    if parts.scheme != scheme or not parts.hostname or port is None:
        raise InvalidArgument(f"bad {scheme} address {uri!r}: expected {scheme}://host:port")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise InvalidArgument(f"bad {scheme} address {uri!r}: expected {scheme}://host:port")
    if port == 0 and not listening:
        raise InvalidArgument(f"cannot connect to port 0 ({uri!r})")
    return parts.hostname, port


def _format_address(addr: Any, scheme: str = "tcp") -> str:
    host, port = addr[0], addr[1]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def fit_fd_limit(connections: int) -> int:
    """How many of ``connections`` this process can serve within its file descriptor limit.

    Needs ``connections`` + :data:`~kvstore.transport.base.MAX_REFUSING` +
    :data:`FD_HEADROOM` descriptors above those open now; raises the soft ``RLIMIT_NOFILE``
    toward the hard limit when that is short (a process-wide change, logged), and returns
    ``connections`` or, when even the hard limit is short, what fits (at least 1). Never
    blocks, never raises.
    """
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 64  # no /proc: assume a typical small process
    need = open_now + MAX_REFUSING + FD_HEADROOM + connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return connections
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the file descriptor limit to %d: %s", target, exc)
        else:
            logger.info("raised the file descriptor limit from %d to %d", soft, target)
            soft = target
    return max(1, min(connections, soft - (need - connections)))


def _tune(sock: socket.socket, buffer_bytes: int | None) -> None:
    """Small control frames must not wait for Nagle; optionally pin the socket buffers."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


class TcpBackend(Backend):
    """Connects and listens on ``tcp://host:port``.

    Option ``socket_buffer_bytes`` (int or None) sets SO_SNDBUF/SO_RCVBUF.
    """

    async def connect(
        self, uri: str, *, timeout: float | None, limits: FrameLimits, **options: Any
    ) -> TcpConnection:
        """Resolve and connect, trying each address in turn; see :class:`Backend`."""
        buffer_bytes = _options(options)
        host, port = parse_tcp_uri(uri)
        return await with_timeout(
            self._connect(host, port, uri, limits, buffer_bytes), timeout, f"connect to {uri}"
        )

    def listener(
        self,
        uri: str,
        handler: Handler,
        *,
        limits: FrameLimits,
        max_connections: int,
        idle_timeout: float | None = None,
        header_timeout: float | None = None,
        refusal: Refusal | None = None,
        **options: Any,
    ) -> TcpListener:
        """An unstarted :class:`TcpListener`; see :class:`Backend`."""
        return TcpListener(
            uri,
            handler,
            limits=limits,
            max_connections=max_connections,
            idle_timeout=idle_timeout,
            header_timeout=header_timeout,
            refusal=refusal,
            socket_buffer_bytes=_options(options),
        )

    async def _connect(
        self,
        host: str,
        port: int,
        uri: str,
        limits: FrameLimits,
        buffer_bytes: int | None,
        make: Callable[[socket.socket, Any], TcpConnection] | None = None,
    ) -> TcpConnection:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise Unreachable(f"cannot resolve {uri}: {exc}") from exc
        errors: list[str] = []
        for family, kind, proto, _, addr in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                _tune(sock, buffer_bytes)
                await loop.sock_connect(sock, addr)
                if make is not None:  # (another backend's connection on this socket)
                    return make(sock, addr)
                return TcpConnection(sock, peer=_format_address(addr), limits=limits)
            except OSError as exc:
                sock.close()
                errors.append(str(exc))
            except BaseException:
                sock.close()
                raise
        raise Unreachable(f"cannot connect to {uri}: {'; '.join(errors) or 'no address'}")


def _options(options: dict[str, Any]) -> int | None:
    unknown = set(options) - {"socket_buffer_bytes"}
    if unknown:
        raise InvalidArgument(f"unknown tcp:// options: {sorted(unknown)}")
    value = options.get("socket_buffer_bytes", DEFAULT_SOCKET_BUFFER_BYTES)
    if value is not None and (not isinstance(value, int) or value <= 0):
        raise InvalidArgument(f"socket_buffer_bytes must be a positive int or None, got {value!r}")
    return value


BACKEND = TcpBackend()
"""The instance the registry in :mod:`kvstore.transport` hands out for ``tcp://``."""

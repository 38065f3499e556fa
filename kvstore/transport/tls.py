"""The ``tls://host:port`` backend: the ``tcp://`` frames inside TLS.

The same framing and the same :class:`~kvstore.transport.tcp.TcpConnection` logic (staging,
deadlines, bounds) run over a shim that looks like the few socket calls they make
(``recv_into``, ``recvmsg_into``, ``sendmsg``, a peek) and drives an :class:`ssl.SSLObject`
over two memory BIOs on the non-blocking socket. The cost is the cipher and one copy each
way: plaintext is encrypted into the outgoing BIO and sent from there, and received
ciphertext is decrypted straight into the caller's view (a slot, a staging buffer) by
``SSLObject.read(n, view)``. ``bench/tls_cost.py`` measures it beside ``tcp://``.

- **Handshake.** Once per connection, before its first frame: the client's in
  :meth:`TlsBackend.connect` (within its ``timeout``), the server's in the connection's
  task before its handler runs (within ``header_timeout``, else 10 s), so a slow or silent
  peer holds no accept loop. A failed handshake raises :class:`~kvstore.errors.Unreachable`
  on the client (naming the certificate problem) and closes the server's connection.
- **Contexts.** The client's :class:`ssl.SSLContext` comes in the ``ssl_context`` option
  (:func:`client_context`: a CA file, optionally a client certificate); without it the
  system's roots verify the node. The listener's comes in the same option
  (:func:`server_context`). TLS 1.3 only, no session tickets (a pooled idle connection
  must look idle: a late ticket would look like an unexpected frame).
- **Bounds.** A ``sendmsg`` encrypts at most :data:`_CHUNK` plaintext bytes per call, so
  at most about that much ciphertext waits for the socket; reads pull at most
  :data:`_CHUNK` ciphertext bytes per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from kvstore.errors import InvalidArgument, KVStoreError, PeerDisconnected, Unreachable
from kvstore.transport.base import (
    REFUSAL_LINGER_S,
    Connection,
    Handler,
    Refusal,
    logger,
    with_timeout,
)
from kvstore.transport.framing import FrameLimits
from kvstore.transport.tcp import (
    TcpBackend,
    TcpConnection,
    TcpListener,
    _format_address,
    _options,
    parse_tcp_uri,
)

__all__ = [
    "BACKEND",
    "TlsBackend",
    "TlsConnection",
    "check_certificate",
    "client_context",
    "server_context",
]

_CHUNK = 256 * 1024
_EMPTY = memoryview(b"")
DEFAULT_HANDSHAKE_S = 10.0


def client_context(ca: str = "", cert: str = "", key: str = "") -> ssl.SSLContext:
    """A client's context: verify the server against ``ca`` (empty: system roots) and its
    name; present ``cert``/``key`` when given. Raises InvalidArgument for a bad file."""
    try:
        ctx = ssl.create_default_context(cafile=ca or None)
        if cert:
            ctx.load_cert_chain(cert, key or None)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise InvalidArgument(f"TLS files for the data port: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


@functools.cache
def _default_client_context() -> ssl.SSLContext:
    """The system roots' context, built once (loading them takes ~60 ms)."""
    return client_context()


_local = threading.local()


def _cipher_buffer() -> memoryview:
    """This thread's buffer for ciphertext pulled off a socket (each event loop runs on one
    thread; a pull copies it into its connection's BIO before it returns)."""
    buf: memoryview | None = getattr(_local, "cipher", None)
    if buf is None:
        buf = _local.cipher = memoryview(bytearray(_CHUNK))
    return buf


def server_context(cert: str, key: str, client_ca: str = "") -> ssl.SSLContext:
    """A listener's context (``client_ca``: require client certificates it signed)."""
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        if client_ca:
            ctx.load_verify_locations(client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise InvalidArgument(f"TLS files for the data port: {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.num_tickets = 0
    return ctx


def check_certificate(cert: str, key: str, host: str = "") -> str:
    """Check at start what every handshake would find later: a TLS handshake with itself,
    in memory, trusting ``cert`` alone (the leaf and any intermediates in the file, as
    partial chains). Raises InvalidArgument when the certificate is expired or not valid
    yet (no client could verify it). Returns a warning, or "", when it does not name
    ``host`` (a client that dials that address would refuse it; one dialing a name the
    certificate lists would not, so it may be meant). A wildcard ``host`` is not checked."""
    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise InvalidArgument(f"TLS certificate {cert} with key {key}: {exc}") from None
    wildcard = not host or host in ("0.0.0.0", "::", "*")
    for named in (False,) if wildcard else (False, True):
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.load_verify_locations(cafile=cert)
        client.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        client.check_hostname = named
        try:
            _handshake_in_memory(client, server, host if named else None)
        except ssl.SSLCertVerificationError as exc:
            why = exc.verify_message or str(exc)
            if named:
                return f"TLS certificate {cert} does not name {host}: {why}"
            raise InvalidArgument(f"TLS certificate {cert}: {why}") from None
        except ssl.SSLError as exc:
            raise InvalidArgument(f"TLS certificate {cert}: a handshake fails: {exc}") from None
    return ""


def _handshake_in_memory(
    client_ctx: ssl.SSLContext, server_ctx: ssl.SSLContext, hostname: str | None
) -> None:
    """A whole TLS handshake between two contexts over memory buffers (bounded steps)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=hostname)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = [False, False]
    for _ in range(16):  # (TLS 1.3 takes two flights each way)
        for i, (side, out, peer_in) in enumerate(((client, c_out, s_in), (server, s_out, c_in))):
            if not done[i]:
                try:
                    side.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
            if out.pending:
                peer_in.write(out.read())
        if all(done):
            return
    raise ssl.SSLError("the handshake did not complete")


class _TlsSocket:
    """The socket calls :class:`TcpConnection` makes, over TLS. ``BlockingIOError`` means
    what it means for a socket: wait for readability (receives) or writability (sends)."""

    def __init__(
        self, sock: socket.socket, ctx: ssl.SSLContext, *, server_side: bool, hostname: str
    ) -> None:
        self.sock = sock
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(
            self._in, self._out, server_side=server_side,
            server_hostname=None if server_side else hostname,
        )  # fmt: skip
        self._tail: memoryview | None = None
        """Ciphertext taken from the outgoing BIO that the socket has not taken yet."""

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    @property
    def unsent(self) -> bool:
        """Ciphertext waits for the socket."""
        return bool(self._tail) or self._out.pending > 0

    def flush(self) -> None:
        """Send pending ciphertext; BlockingIOError if the socket takes not all of it (the
        rest is kept, in order)."""
        while True:
            if not self._tail:
                if not self._out.pending:
                    return
                self._tail = memoryview(self._out.read())
            sent = self.sock.send(self._tail)
            self._tail = self._tail[sent:]

    def pull(self) -> bool:
        """Move ciphertext from the socket into the TLS object; False at EOF."""
        buf = _cipher_buffer()
        got = self.sock.recv_into(buf)
        if not got:
            self._in.write_eof()
            return False
        self._in.write(buf[:got])  # (copied into the BIO at once: one buffer per thread)
        return True

    def recv_into(self, view: memoryview) -> int:
        """Decrypt into ``view`` as much as is here (one read is one TLS record, at most
        16 KiB: reading on until the ciphertext runs out saves the caller's loop a trip per
        record); BlockingIOError only when nothing at all could be read."""
        got = 0
        while got < len(view):
            try:
                n = int(self.obj.read(len(view) - got, view[got:]))
            except ssl.SSLWantReadError:
                if got:
                    return got
                if self.unsent:  # (a post-handshake message of ours, or a send's rest:
                    with contextlib.suppress(BlockingIOError):  # its sender waits on it)
                        self.flush()
                self.pull()
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return got  # close_notify, or the socket ended: end of stream either way
            except ssl.SSLError as exc:
                raise OSError(f"TLS: {exc.reason or exc}") from exc
            if not n:
                return got
            got += n
        return got

    def recvmsg_into(self, buffers: list[memoryview]) -> tuple[int, list[Any], int, Any]:
        # (nothing spills: the caller reads the rest of the stream by later calls)
        return self.recv_into(buffers[0]), [], 0, None

    def sendmsg(self, iov: list[memoryview]) -> int:
        self.flush()  # BlockingIOError here: nothing of iov taken
        taken = 0
        try:
            for view in iov:
                piece = view[: _CHUNK - taken]
                self.obj.write(piece)
                taken += piece.nbytes
                if taken >= _CHUNK:
                    break
        except ssl.SSLError as exc:
            raise OSError(f"TLS: {exc.reason or exc}") from exc
        try:
            self.flush()
        except BlockingIOError:
            pass  # kept in unsent; the connection flushes it before the frame counts
        return taken

    def recv(self, n: int, flags: int = 0) -> bytes:
        """Only the peek :class:`TcpConnection` uses to tell an idle connection."""
        if self.obj.pending() or self._in.pending:  # (records pulled, not yet read)
            return b"\x00"
        return self.sock.recv(n, flags)


class TlsConnection(TcpConnection):
    """A :class:`TcpConnection` whose bytes travel inside TLS (see the module docstring)."""

    _LOWAT = False

    def __init__(
        self,
        sock: socket.socket,
        ctx: ssl.SSLContext,
        *,
        peer: str,
        server_side: bool,
        hostname: str = "",
        limits: FrameLimits,
    ) -> None:
        sock.setblocking(False)
        self._tls = _TlsSocket(sock, ctx, server_side=server_side, hostname=hostname)
        super().__init__(sock, peer=peer, limits=limits)
        self._sock = self._tls  # type: ignore[assignment]

    async def handshake(self, timeout: float | None) -> None:
        """Complete the TLS handshake; raises Unreachable (why), KVTimeout."""

        async def run() -> None:
            while True:
                try:
                    self._tls.obj.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await self._flush_all()
                    try:
                        if not self._tls.pull():
                            raise PeerDisconnected(f"{self.peer} closed during the TLS handshake")
                    except BlockingIOError:
                        await self._wait_io(write=False)
                except ssl.SSLError as exc:
                    with contextlib.suppress(OSError):  # (best effort: the peer learns why)
                        self._tls.flush()
                    why = getattr(exc, "verify_message", None) or exc.reason or exc
                    raise Unreachable(f"TLS handshake with {self.peer} failed: {why}") from None
            await self._flush_all()

        try:
            await with_timeout(run(), timeout, f"TLS handshake with {self.peer}")
        except KVStoreError:
            raise  # (some of ours are OSErrors too)
        except OSError as exc:
            raise self._translate(exc, "TLS handshake") from exc

    async def _flush_all(self) -> None:
        while True:
            try:
                self._tls.flush()
                return
            except BlockingIOError:
                await self._wait_io(write=True)

    def _write_now(self, iov: list[memoryview]) -> list[memoryview]:
        rest = super()._write_now(iov)
        return rest if rest or not self._tls.unsent else [_EMPTY]

    async def _write_rest(self, iov: list[memoryview]) -> None:
        await super()._write_rest(iov)
        while self._tls.unsent:
            await super()._write_rest([_EMPTY])


class TlsListener(TcpListener):
    """A :class:`TcpListener` whose connections speak TLS (``ssl_context``: the server's)."""

    def __init__(
        self, uri: str, handler: Handler, *, ssl_context: ssl.SSLContext, **kwargs: Any
    ) -> None:
        self._ctx = ssl_context
        limit = kwargs.get("header_timeout") or DEFAULT_HANDSHAKE_S
        super().__init__(uri, _handshaking(handler, limit), scheme="tls", **kwargs)

    def _wrap(self, sock: socket.socket, peer: str) -> TcpConnection:
        return TlsConnection(sock, self._ctx, peer=peer, server_side=True, limits=self.limits)

    async def _send_refusal(self, conn: Connection, refusal: Refusal) -> None:
        """The refusal frame, inside TLS: the handshake first (bounded), else a close."""
        assert isinstance(conn, TlsConnection)
        try:
            await conn.handshake(REFUSAL_LINGER_S)
        except BaseException as exc:  # (a failed handshake, or stop() cancelling it)
            await conn.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        await super()._send_refusal(conn, refusal)

    async def _bind(self) -> None:
        """Bind; a host given by name is kept in :attr:`address` (clients check the node's
        certificate against that name, not the address it resolved to)."""
        await super()._bind()
        try:
            ipaddress.ip_address(self._host.strip("[]"))
        except ValueError:
            port = self._address.rsplit(":", 1)[1]
            self._address = f"tls://{self._host}:{port}"


def _handshaking(handler: Handler, timeout: float) -> Callable[[Connection], Awaitable[None]]:
    async def serve(conn: Connection) -> None:
        assert isinstance(conn, TlsConnection)
        try:
            await conn.handshake(timeout)
        except KVStoreError as exc:
            # (a client that does not trust this certificate, a port scanner: closed)
            logger.info("TLS handshake with %s failed: %s", conn.peer, exc)
            return
        await handler(conn)

    return serve


class TlsBackend(TcpBackend):
    """Connects and listens on ``tls://host:port``: option ``ssl_context`` (see the module
    docstring), and ``socket_buffer_bytes`` as for ``tcp://``."""

    async def connect(
        self, uri: str, *, timeout: float | None, limits: FrameLimits, **options: Any
    ) -> TcpConnection:
        """Connect and complete the handshake within ``timeout``; see :class:`Backend`."""
        ctx = options.pop("ssl_context", None) or _default_client_context()
        if not isinstance(ctx, ssl.SSLContext):
            raise InvalidArgument("ssl_context must be an ssl.SSLContext")
        buffer_bytes = _options(options)
        host, port = parse_tcp_uri(uri, scheme="tls")

        def make(sock: socket.socket, addr: Any) -> TcpConnection:
            return TlsConnection(sock, ctx, peer=_format_address(addr, "tls"),
                                 server_side=False, hostname=host, limits=limits)  # fmt: skip

        async def dial() -> TcpConnection:
            conn = await self._connect(host, port, uri, limits, buffer_bytes, make)
            assert isinstance(conn, TlsConnection)
            try:
                # (the whole dial has the deadline; without one the handshake still has)
                await conn.handshake(None if timeout is not None else DEFAULT_HANDSHAKE_S)
            except BaseException:
                await conn.close()
                raise
            return conn

        return await with_timeout(dial(), timeout, f"connect to {uri}")

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
        """An unstarted :class:`TlsListener` (``ssl_context`` required)."""
        ctx = options.pop("ssl_context", None)
        if not isinstance(ctx, ssl.SSLContext):
            raise InvalidArgument("a tls:// listener needs ssl_context (server_context())")
        return TlsListener(
            uri, handler, ssl_context=ctx, limits=limits, max_connections=max_connections,
            idle_timeout=idle_timeout, header_timeout=header_timeout, refusal=refusal,
            socket_buffer_bytes=_options(options),
        )  # fmt: skip


BACKEND = TlsBackend()
"""The instance the registry in :mod:`kvstore.transport` hands out for ``tls://``."""

"""The master process's server: a ``grpc.aio`` server around :class:`MasterService` plus the
lease sweeper. ``kvstore master`` and ``kvstore serve`` build one from a
:class:`MasterConfig`::

    async with MasterServer(MasterConfig(grpc_port=0)) as master:
        print(master.address)            # "127.0.0.1:<port>"

The port opens only once the server can serve (the index store answered and the nodes it
knows got their grace lease), its commit port (:mod:`kvstore.control.commit_port`) just
before it; stopping ends open watches, then stops both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import grpc

from kvstore.control import wire
from kvstore.control.auth import AuthConfig, AuthInterceptor
from kvstore.control.commit_port import CommitPort
from kvstore.dataplane.handshake import ticket_root
from kvstore.errors import Closed, InvalidArgument, KVStoreError, TransportError
from kvstore.master.index import IndexStore, MemoryIndexStore
from kvstore.master.membership import Membership
from kvstore.master.service import MasterService, status_for
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

__all__ = ["MasterConfig", "MasterServer", "grpc_address"]

log = logging.getLogger(__name__)


def grpc_address(host: str, port: int) -> str:
    """``host:port`` for gRPC, bracketing a bare IPv6 host."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


@dataclass(frozen=True)
class MasterConfig:
    """Settings of one master (validated on construction; raises InvalidArgument).

    ``grpc_port`` 0 picks a free port; so does ``commit_port`` (the port nodes send their
    commits to, :mod:`kvstore.control.commit_port`; None: none, they commit over gRPC).
    ``node_lease_s`` is the node lease (heartbeats every
    lease/3, suspect after lease/2, dead after a lease). ``watch_queue`` bounds the events
    buffered per watcher; ``watch_max_s`` bounds a watch's lifetime.
    """

    host: str = "127.0.0.1"
    grpc_port: int = 50051
    commit_port: int | None = 0
    node_lease_s: float = 10.0
    max_message_bytes: int = wire.MAX_MESSAGE_BYTES
    watch_queue: int = 16384
    watch_max_s: float = 3600.0

    def __post_init__(self) -> None:
        if not 0 <= self.grpc_port <= 65535:
            raise InvalidArgument(f"grpc port {self.grpc_port} out of range")
        if self.commit_port is not None and not 0 <= self.commit_port <= 65535:
            raise InvalidArgument(f"commit port {self.commit_port} out of range")
        if not self.node_lease_s > 0:
            raise InvalidArgument(f"node lease must be > 0 s, got {self.node_lease_s}")
        if self.max_message_bytes < 1 << 20:
            raise InvalidArgument("max_message_bytes must be at least 1 MiB")
        if self.watch_queue < 1 or not self.watch_max_s > 0:
            raise InvalidArgument("watch_queue must be >= 1 and watch_max_s > 0")
        if not self.host:
            raise InvalidArgument("host must not be empty")


class MasterServer:
    """A running master: gRPC server, service and sweeper. Not reusable after :meth:`stop`.

    ``store`` defaults to a new :class:`MemoryIndexStore`, owned (closed on stop); a store
    passed in is left open. ``clock`` (monotonic seconds) drives leases.
    """

    def __init__(
        self,
        config: MasterConfig,
        store: IndexStore | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        auth: AuthConfig | None = None,
        tls: grpc.ServerCredentials | None = None,
        commit_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.config = config
        self.auth = auth
        """With an auth file: every call needs a token of a role that may make it."""
        self.tls = tls
        """With credentials (:func:`kvstore.control.tls.server_credentials`): the port
        :meth:`start` opens speaks TLS only."""
        self.commit_tls = commit_tls
        """A TLS server context (:func:`kvstore.transport.tls.server_context`, the same
        certificate): the commit port speaks ``tls://`` only."""
        self._owns_store = store is None
        self.store: IndexStore = store if store is not None else MemoryIndexStore()
        self.membership = Membership(config.node_lease_s)
        self.service = MasterService(
            self.store,
            self.membership,
            clock=clock,
            watch_queue=config.watch_queue,
            watch_max_s=config.watch_max_s,
            auth=auth,
        )
        self.port = 0
        """The bound port (the real one when the config asked for 0); 0 before start."""
        self._server: grpc.aio.Server | None = None
        self._extra: list[grpc.aio.Server] = []
        self.commits: CommitPort | None = None
        """The commit port, once started (None: the config has none)."""
        self._sweeper: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def address(self) -> str:
        """``host:port`` clients dial (valid after :meth:`start`)."""
        return grpc_address(self.config.host, self.port)

    async def start(self) -> None:
        """Restore leases from the store, bind and start serving, start the sweeper.

        Raises :class:`TransportError` if the port cannot be bound, :class:`Closed` after
        stop, and what the store raises.
        """
        if self._server is not None or self._stopped:
            raise Closed("MasterServer.start() called twice or after stop()")
        restored = await self.service.restore()
        if restored:
            log.info("restored %d nodes with one lease of grace", restored)
        if self.config.commit_port is not None:  # (first: Register answers carry its port)
            commits = CommitPort(
                self.service.commit_frame,
                status_for,
                host=self.config.host,
                port=self.config.commit_port,
                max_bytes=self.config.max_message_bytes,
                root=ticket_root(self.auth.cluster_secret) if self.auth is not None else None,
                ssl_context=self.commit_tls,
                on_link=self.service.counters.count_commit_link,
            )
            await commits.start()
            self.commits = commits
            self.service.commit_port = commits.port
        try:
            server, port = await self._serve_on(self.config.host, self.config.grpc_port, self.tls)
        except BaseException:
            if self.commits is not None:
                await self.commits.stop(0)
                self.commits, self.service.commit_port = None, 0
            raise
        self._server = server
        self.port = port
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="kvstore-master-sweeper")
        log.info("master serving on %s (lease %.3g s)", self.address, self.config.node_lease_s)

    async def listen(self, host: str, port: int, tls: grpc.ServerCredentials | None = None) -> int:
        """Serve the same master on one more ``host:port`` (``kvstore serve`` opens its
        public port this way once its node registered), with TLS given ``tls``; returns the
        bound port. Stopped by :meth:`stop`. Raises :class:`TransportError` if the port
        cannot be bound."""
        if self._server is None or self._stopped:
            raise Closed("MasterServer.listen() needs a started server")
        server, bound = await self._serve_on(host, port, tls)
        self._extra.append(server)
        log.info("master serving on %s too", grpc_address(host, bound))
        return bound

    async def _serve_on(
        self, host: str, port: int, tls: grpc.ServerCredentials | None
    ) -> tuple[grpc.aio.Server, int]:
        """A started grpc.aio server carrying this master's service on ``host:port``."""
        limit = self.config.max_message_bytes
        server = grpc.aio.server(
            interceptors=[AuthInterceptor(self.auth)] if self.auth is not None else None,
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", 0),  # a taken port must fail, not be shared
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_timeout_ms", 10_000),
            ],
        )
        pb_grpc.add_MasterServicer_to_server(self.service, server)
        target = grpc_address(host, port)
        try:
            if tls is not None:
                bound = server.add_secure_port(target, tls)
            else:
                bound = server.add_insecure_port(target)
        except RuntimeError as exc:
            raise TransportError(f"cannot bind the master's gRPC port {target}: {exc}") from exc
        if bound == 0:
            raise TransportError(f"cannot bind the master's gRPC port {target}")
        await server.start()
        return server, bound

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stop the sweeper, end open watches and commit streams, stop gRPC and the commit
        port (in-flight calls and batches get ``grace`` seconds), close an owned store.
        Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        self.service.close_streams()
        servers = [*self._extra, *([self._server] if self._server else [])]
        await asyncio.gather(  # (side by side: each gets the grace, not one after the other)
            *([self.commits.stop(grace or 0.0)] if self.commits is not None else []),
            *(server.stop(grace) for server in servers),
        )
        if self._owns_store:
            await self.store.close()

    async def __aenter__(self) -> MasterServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _sweep_forever(self) -> None:
        """Sweep leases every interval. A failure is logged once (in one line when it is
        one of ours, a store that cannot be reached; with its traceback when not, a bug),
        then in one line a minute while it lasts (the store down: one sweep a second), and
        its end is said."""
        interval = self.membership.sweep_interval_s
        failing_since: float | None = None
        said = 0.0
        while True:
            await asyncio.sleep(interval)
            try:
                await self.service.sweep()
            except Closed:
                return
            except Exception as exc:  # a store hiccup or a bug: log it, keep leases expiring
                now = time.monotonic()
                if failing_since is None:
                    failing_since = said = now
                    if isinstance(exc, KVStoreError):
                        log.error("lease sweep failed: %s", exc)
                    else:
                        log.exception("lease sweep failed")
                elif now - said >= 60.0:
                    said = now
                    log.error("lease sweep still failing after %.0f s: %s",
                              now - failing_since, exc)  # fmt: skip
            else:
                if failing_since is not None:
                    log.warning("lease sweep works again after %.0f s",
                                time.monotonic() - failing_since)  # fmt: skip
                    failing_since = None

"""A node's heartbeats to its master, on a thread of their own.

A heartbeat renews the node's lease and carries its latest usage and counters; its answer
says whether to register again, whether the node is draining and its tenants' quotas.
Heartbeats run on a thread with their own gRPC channels (never on the node's event loop),
so a loop busy with a long exchange never costs the node its lease. Several masters
sharing one Redis (``a:p,b:p``): a heartbeat that fails moves on to the next, which knows
the node's epoch from the store they share. This is the node's one way to its master
besides :class:`~kvstore.control.client.MasterClient`, which owns the identity both use
(its ``session``, token and TLS).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from kvstore.control.auth import bearer
from kvstore.control.client import MasterClient
from kvstore.control.tls import channel_credentials
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

__all__ = ["Heartbeats"]

logger = logging.getLogger("kvstore.node")


class Heartbeats:
    """Every ``period_s``, the request ``beat()`` builds (on the heartbeat thread: it must
    only read what the node's loop publishes) sent to the current master at ``address``;
    each answer goes to ``answered`` (on the heartbeat thread: hand it to the loop). A
    master that fails or does not answer within its share of the period is passed over for
    the next. :meth:`stop` ends the thread (bounded)."""

    def __init__(
        self,
        master: MasterClient,
        address: str,
        period_s: Callable[[], float],
        beat: Callable[[], pb.HeartbeatRequest],
        answered: Callable[[pb.HeartbeatResponse], None],
        *,
        name: str,
    ) -> None:
        self.targets = [t.strip() for t in address.split(",") if t.strip()]
        self._master = master
        self._period_s = period_s
        self._beat = beat
        self._answered = answered
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Blocking: stop beating and wait for the thread, at most ``timeout_s``."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        tls = self._master.tls
        creds = channel_credentials(tls) if tls is not None else None
        channels = [
            grpc.secure_channel(t, creds) if creds is not None else grpc.insecure_channel(t)
            for t in self.targets
        ]
        current = 0
        try:
            # The first beat goes at once: it opens the channel while the registration is
            # fresh, so a node whose start keeps it busy is not suspect for a late first
            # beat (its channel's set-up came on top of a period: docs/decisions.md).
            while not self._stop.is_set():
                for _ in channels:  # bounded: each master once per beat
                    request = self._beat()
                    request.session = self._master.session
                    try:
                        reply = pb_grpc.MasterStub(channels[current]).Heartbeat(
                            request,
                            timeout=max(1.0, self._period_s() / len(channels)),
                            metadata=bearer(self._master.token),
                        )
                    except grpc.RpcError as exc:
                        logger.warning("heartbeat to %s failed: %s (%s)", self.targets[current],
                                       exc.details(), exc.code().name)  # fmt: skip
                        current = (current + 1) % len(channels)
                        continue
                    self._answered(reply)
                    break
                self._stop.wait(self._period_s())
        finally:
            for channel in channels:
                channel.close()

"""Prometheus metrics (DESIGN.md, "Metrics").

Each server process builds one :class:`Metrics` on its own ``CollectorRegistry`` and hands
it to the parts it runs. In ``kvstore serve`` the master and the node share that one
object; every metric has exactly one owner, and ``kvstore_blocks`` carries a ``role`` label
(``master``: blocks in the index, ``node``: slots held) so nothing is registered twice.

Owners: master — ``kvstore_prefix_lookups_total`` and ``kvstore_prefix_hit_tokens_total``
(exported by a collector over the master's own counters, see ``kvstore.cli``) and
``kvstore_rpc_seconds{method}``; node — everything else.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvstore.errors import InvalidArgument

__all__ = ["Metrics", "MetricsServer"]

_TRANSFER_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
_RPC_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25, 1, 5)


@dataclass
class Metrics:
    """Every kvstore metric, registered once on ``registry``."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.pool_bytes = Gauge(
            "kvstore_pool_bytes", "Pool memory by tier and state", ["tier", "state"], registry=r
        )
        self.blocks = Gauge("kvstore_blocks", "Cached blocks", ["role"], registry=r)
        self.transfer_bytes = Counter(
            "kvstore_transfer_bytes_total",
            "Chunk bytes moved by the data plane",
            ["op", "transport"],
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "kvstore_transfer_seconds",
            "Data-plane exchange time (one batch)",
            ["op", "transport"],
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        self.evictions = Counter("kvstore_evictions_total", "Slots evicted", ["tier"], registry=r)
        self.stale_misses = Counter(
            "kvstore_stale_misses_total",
            "Reads of chunks the index listed but the node no longer had",
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "kvstore_rpc_seconds",
            "Master RPC handling time",
            ["method"],
            buckets=_RPC_BUCKETS,
            registry=r,
        )


class MetricsServer:
    """``/metrics`` over HTTP on its own daemon thread; ``close()`` is idempotent."""

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        try:
            server, thread = start_http_server(port, addr=host, registry=metrics.registry)
        except OSError as exc:
            raise InvalidArgument(f"cannot bind metrics port {host}:{port}: {exc}") from exc
        self._server: WSGIServer | None = server
        self._thread: threading.Thread = thread
        self.port: int = server.server_port
        self.host = host

    @property
    def address(self) -> str:
        """``host:port`` actually bound."""
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop serving (blocks up to the poll interval of the HTTP server)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
            self._thread.join(timeout=5)

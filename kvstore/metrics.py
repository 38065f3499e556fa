"""Prometheus metrics (docs/architecture.md, "Metrics").

Each server process builds one :class:`Metrics` on its own ``CollectorRegistry`` and hands
it to the parts it runs. In ``kvstore serve`` the master and the node share that one
object; every metric has exactly one owner, and ``kvstore_blocks`` carries a ``role`` label
(``master``: blocks in the index, ``node``: slots held) so nothing is registered twice.

Owners: master — ``kvstore_prefix_lookups_total``, ``kvstore_prefix_hit_tokens_total``,
``kvstore_prefix_miss_tokens_total`` and ``kvstore_commit_links_total`` (exported by a
collector over the master's own counters, see ``kvstore.cli``),
``kvstore_rpc_seconds{method}``, ``kvstore_nodes{state}`` and ``kvstore_blocks{role="master"}``
(both set after every lease sweep); node — everything else.

:class:`MetricsServer` serves ``/metrics`` with prometheus_client's encoders (text 0.0.4 or
OpenMetrics as the scrape's ``Accept`` asks, gzip when accepted, ``name[]`` filters) from a
small HTTP server of its own rather than ``start_http_server``, which starts a thread per
connection and waits on each forever: 200 idle sockets cost a node 200 threads. Here the
connections served at once, the time a request may take to arrive and to be read, and the
request's size are all bounded (docs/decisions.md).
"""

from __future__ import annotations

import gzip
import logging
import selectors
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics import MetricWrapperBase

from kvstore.errors import InvalidArgument

__all__ = [
    "DEFAULT_SCRAPE_CONNECTIONS",
    "DEFAULT_SCRAPE_REQUEST_BYTES",
    "DEFAULT_SCRAPE_TIMEOUT_S",
    "Metrics",
    "MetricsServer",
]

logger = logging.getLogger("kvstore.metrics")

DEFAULT_SCRAPE_CONNECTIONS = 8
"""Requests served at once. Prometheus scrapes a target over one connection at a time (an HA
pair: two), so 8 leaves room for people with curl; one more is answered 503 at once."""

DEFAULT_SCRAPE_TIMEOUT_S = 5.0
"""How long a request may take to arrive whole after its connection is accepted, and again
how long the client may take to read the answer; then the connection is closed. A scrape
request arrives in one segment; Prometheus' default scrape_timeout is 10 s."""

DEFAULT_SCRAPE_REQUEST_BYTES = 8 * 1024
"""Longest request head (request line and headers) accepted; longer: 431 and close. A
Prometheus 3 scrape request is ~400 bytes (its Accept header, reproduced in
tests/test_dataport_limits.py); 8 KiB leaves room for an Authorization bearer token."""

_METRICS_PATHS = ("/metrics", "/")
_RECV_BYTES = 4096

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
        self.tier_moves = Counter(
            "kvstore_tier_moves_total",
            "Blocks moved between a node's tiers (to host: demoted from the GPU tier, or staged "
            "up from disk for a read; to gpu: promoted on a read; to disk: left host memory "
            "with a disk copy)",
            ["to"],
            registry=r,
        )
        self.disk_bytes = Counter(
            "kvstore_disk_bytes_total", "Bytes the disk tier wrote and read", ["op"], registry=r
        )
        self.disk_seconds = Histogram(
            "kvstore_disk_seconds",
            "Disk tier I/O time (one write batch, one record read)",
            ["op"],
            buckets=_TRANSFER_BUCKETS,
            registry=r,
        )
        self.disk_errors = Counter(
            "kvstore_disk_errors_total",
            "Disk tier faults: failed writes and reads (by errno) and records that did not "
            "verify (reason checksum)",
            ["op", "reason"],
            registry=r,
        )
        self.disk_blocks = Gauge(
            "kvstore_disk_blocks", "Blocks the disk tier holds a copy of", registry=r
        )
        self.tenant_bytes = Gauge(
            "kvstore_tenant_bytes", "Pool memory held by each tenant's blocks", ["tenant"],
            registry=r,
        )  # fmt: skip
        self.tenant_quota_bytes = Gauge(
            "kvstore_tenant_quota_bytes",
            "Each tenant's quota on this node (its share of the pool quota)",
            ["tenant"],
            registry=r,
        )
        self.tenant_evictions = Counter(
            "kvstore_tenant_evictions_total",
            "Slots evicted to make room, by the tenant whose block it was",
            ["tenant"],
            registry=r,
        )
        self.stale_misses = Counter(
            "kvstore_stale_misses_total",
            "Reads of chunks the index listed but the node no longer had",
            registry=r,
        )
        self.transfer_errors = Counter(
            "kvstore_transfer_errors_total",
            "Data-plane exchanges refused or dropped, and chunks that failed a node's check",
            ["op", "transport", "reason"],
            registry=r,
        )
        self.nodes = Gauge(
            "kvstore_nodes", "Storage nodes the master knows, by state", ["state"], registry=r
        )
        self.rpc_seconds = Histogram(
            "kvstore_rpc_seconds",
            "Master RPC handling time",
            ["method"],
            buckets=_RPC_BUCKETS,
            registry=r,
        )
        # Labelled children, found once: ``labels()`` costs ~1 µs a call, on every exchange
        # and every RPC (a few op and transport pairs and RPC names: bounded).
        self._transfers: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        self._rpcs: dict[str, Histogram] = {}

    def master_only(self) -> None:
        """Export only what the master owns, for a process that runs no node: the node's
        metrics are unregistered (each unlabelled one would otherwise be exported at 0, a
        master posing as a node with an empty disk tier). The master's own are those the
        module docstring names, its collector's included (registered apart)."""
        mine = (self.blocks, self.nodes, self.rpc_seconds)
        for collector in vars(self).values():
            if isinstance(collector, MetricWrapperBase) and all(collector is not m for m in mine):
                self.registry.unregister(collector)

    def node_only(self) -> None:
        """Export only what a node owns, for a process that runs no master: the master's
        own metrics (node states, RPC times) are unregistered, which a node would
        otherwise list with no sample at all."""
        for collector in (self.nodes, self.rpc_seconds):
            self.registry.unregister(collector)

    def count_transfer(self, op: str, transport: str, nbytes: int, started: float) -> None:
        """Count one data-plane exchange of ``nbytes`` that started at ``started``
        (``time.perf_counter``)."""
        pair = self._transfers.get((op, transport))
        if pair is None:
            pair = self._transfers[op, transport] = (
                self.transfer_bytes.labels(op=op, transport=transport),
                self.transfer_seconds.labels(op=op, transport=transport),
            )
        pair[0].inc(nbytes)
        pair[1].observe(time.perf_counter() - started)

    def observe_rpc(self, method: str, seconds: float) -> None:
        """Time one master RPC (``kvstore_rpc_seconds{method}``)."""
        child = self._rpcs.get(method)
        if child is None:
            child = self._rpcs[method] = self.rpc_seconds.labels(method=method)
        child.observe(seconds)


class _HttpError(Exception):
    """A request answered with ``status`` and a one-line ``reason`` as its body."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


_STATUS_TEXT = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class MetricsServer:
    """``GET /metrics`` (also ``/`` and ``HEAD``) over HTTP/1.1, one request per connection,
    served on threads of its own; ``close()`` is idempotent.

    At most ``max_connections`` requests are served at once, each on its own thread; one
    more connection is answered ``503`` at once and closed (counted in ``refused``). A
    request must arrive whole within ``timeout_s`` of its connection being accepted and fit
    in ``max_request_bytes`` (else ``408`` / ``431``, and the connection is closed); the
    client then has ``timeout_s`` to read the answer. Raises
    :class:`~kvstore.errors.InvalidArgument` when the port cannot be bound or a bound is not
    positive.
    """

    def __init__(
        self,
        metrics: Metrics,
        host: str,
        port: int,
        *,
        max_connections: int = DEFAULT_SCRAPE_CONNECTIONS,
        timeout_s: float = DEFAULT_SCRAPE_TIMEOUT_S,
        max_request_bytes: int = DEFAULT_SCRAPE_REQUEST_BYTES,
    ) -> None:
        if max_connections < 1 or not timeout_s > 0 or max_request_bytes < 64:
            raise InvalidArgument(
                "metrics server bounds: max_connections >= 1, timeout_s > 0, "
                f"max_request_bytes >= 64; got {max_connections}, {timeout_s}, "
                f"{max_request_bytes}"
            )
        self.host = host
        self.max_connections = max_connections
        self.timeout_s = float(timeout_s)
        self.max_request_bytes = max_request_bytes
        self.refused = 0
        self._registry = metrics.registry
        self._sock = _bind(host, port)
        self.port: int = self._sock.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._active: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"kvstore-metrics-{self.port}", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        """``host:port`` actually bound."""
        return f"{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        """Requests being served now."""
        with self._lock:
            return len(self._active)

    def close(self) -> None:
        """Stop accepting, cut the requests in progress and wait for their threads (blocks
        briefly: at most ~1 s per thread that does not end)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            active = dict(self._active)
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        for conn in active:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
            except OSError:
                pass
        for thread in active.values():
            thread.join(timeout=1)
        for sock in (self._sock, self._wake_r, self._wake_w):
            sock.close()

    # -- accepting ------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._closed:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    try:
                        conn, _ = self._sock.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as exc:  # EMFILE and friends: back off, do not spin
                        logger.warning("metrics accept failed: %s", exc)
                        time.sleep(0.1)
                        continue
                    self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        """Serve ``conn`` on a thread of its own, or answer 503 when at the bound."""
        with self._lock:
            admitted = not self._closed and len(self._active) < self.max_connections
            if admitted:
                thread = threading.Thread(
                    target=self._serve, args=(conn,), name="kvstore-metrics-request", daemon=True
                )
                self._active[conn] = thread
        if admitted:
            thread.start()
            return
        self.refused += 1
        conn.setblocking(False)  # never let one refusal hold up the accept loop
        try:
            conn.send(_response(503, "text/plain", b"too many metrics connections\n"))
        except OSError:
            pass
        conn.close()

    # -- one request ----------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        try:
            deadline = time.monotonic() + self.timeout_s
            try:
                head = self._read_head(conn, deadline)
                if head is None:
                    return  # the client closed without a request
                response = self._answer(head)
            except _HttpError as exc:
                response = _response(exc.status, "text/plain", f"{exc.reason}\n".encode())
            conn.settimeout(self.timeout_s)  # bounds the whole sendall
            conn.sendall(response)
        except OSError as exc:  # the client went away or was too slow (TimeoutError)
            logger.debug("metrics request dropped: %s", exc)
        finally:
            # The slot is given back before the close that tells the client the answer is
            # over: a client that asks again at once is not refused for its own last request.
            with self._lock:
                self._active.pop(conn, None)
            conn.close()

    def _read_head(self, conn: socket.socket, deadline: float) -> bytes | None:
        """The request line and headers, read by ``deadline`` and within the size bound;
        None when the client closed first."""
        buf = bytearray()
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                return bytes(buf[:end])
            if len(buf) > self.max_request_bytes:
                raise _HttpError(431, f"request head over {self.max_request_bytes} bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise _HttpError(408, f"request not received within {self.timeout_s:g} s")
            conn.settimeout(left)
            try:
                chunk = conn.recv(_RECV_BYTES)
            except TimeoutError:
                continue  # the deadline check above answers it
            if not chunk:
                return None
            buf += chunk

    def _answer(self, head: bytes) -> bytes:
        """The whole response to one request head; raises :class:`_HttpError`."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _HttpError(400, "malformed request line")
        method, target, _ = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon:
                raise _HttpError(400, "malformed header line")
            headers[name.strip().lower()] = value.strip()
        if method not in ("GET", "HEAD"):
            raise _HttpError(405, f"{method} not allowed: GET or HEAD")
        url = urllib.parse.urlsplit(target)
        if url.path not in _METRICS_PATHS:
            raise _HttpError(404, f"{url.path} not found: try /metrics")
        names = urllib.parse.parse_qs(url.query).get("name[]")
        registry = self._registry.restricted_registry(names) if names else self._registry
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        try:
            body = encoder(registry)
        except Exception as exc:
            logger.exception("collecting metrics failed")
            raise _HttpError(500, f"collecting metrics failed: {type(exc).__name__}") from exc
        encoding = None
        if "gzip" in headers.get("accept-encoding", "").lower():
            body, encoding = gzip.compress(body), "gzip"
        return _response(200, content_type, body, encoding=encoding, head=method == "HEAD")


def _response(
    status: int, content_type: str, body: bytes, *, encoding: str | None = None, head: bool = False
) -> bytes:
    """An HTTP/1.1 response that closes the connection."""
    lines = [
        f"HTTP/1.1 {status} {_STATUS_TEXT[status]}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if status == 405:
        lines.append("Allow: GET, HEAD")
    if encoding:
        lines.append(f"Content-Encoding: {encoding}")
    raw = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return raw if head else raw + body


def _bind(host: str, port: int) -> socket.socket:
    """A non-blocking listening socket on ``host:port``; InvalidArgument when it cannot be."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise InvalidArgument(f"cannot bind metrics port {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(64)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise InvalidArgument(f"cannot bind metrics port {host}:{port}: {exc}") from exc
    return sock

"""``kvstore serve | master | node``: thin entry points over the library.

Each command parses flags, builds typed configs, starts its servers in one event loop and
prints one flushed line containing ``kvstore ready`` and its addresses once it can serve.
A bad flag or an unbindable port exits non-zero with one line on stderr. SIGTERM (or
SIGINT) stops accepting, drains, stops the gRPC server with a grace period and exits 0.

``serve`` runs a master and one node in one process: the node registers and commits by
calling the master's handlers directly (``MasterClient.in_process``; its heartbeats use a
private loopback gRPC port), and only then is the public ``--grpc-port`` opened, so a
client that reaches it always finds a node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import NoReturn

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore import __version__
from kvstore.core.arena import parse_size
from kvstore.errors import KVStoreError
from kvstore.master.client import MasterClient
from kvstore.master.redis_store import RedisIndexStore
from kvstore.master.server import MasterConfig, MasterServer, grpc_address
from kvstore.metrics import Metrics, MetricsServer
from kvstore.node.server import NodeConfig, StorageNode

__all__ = ["main"]

log = logging.getLogger("kvstore")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except KVStoreError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from exc
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} outside 0..65535")
    return port


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``kvstore`` argument parser (one subcommand per process kind)."""
    parser = _Parser(prog="kvstore", description="KV-cache pool for disaggregated inference")
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("KVSTORE_LOG", "WARNING"))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p: argparse.ArgumentParser, metrics_port: int) -> None:
        p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
        p.add_argument("--metrics-port", type=_port, default=metrics_port)

    def master_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--grpc-port", type=_port, default=50051)
        p.add_argument("--node-lease-s", type=_positive, default=10.0)

    def node_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--data-port", type=_port, default=50052)
        p.add_argument("--node-id", default="")
        p.add_argument("--host-mem", type=_size, default=parse_size("512MiB"))
        p.add_argument(
            "--gpu-mem",
            type=_size,
            default=0,
            help="a GPU tier of this size on the current CUDA device, where ucx:// puts land "
            "(default none)",
        )
        p.add_argument(
            "--transport",
            choices=["tcp", "ucx"],
            default="tcp",
            help="ucx: also serve one-sided NIXL/UCX reads and writes (needs nixl-cu12)",
        )
        p.add_argument(
            "--io-timeout-s",
            type=_positive,
            default=NodeConfig.io_timeout_s,
            help="deadline of each step of a data-plane exchange; also how long a stalled "
            "writer can hold a chunk others wait for (default %(default)s)",
        )
        p.add_argument(
            "--max-connections",
            type=_count,
            default=NodeConfig.max_connections,
            help="data-port connections served at once; more are refused with a capacity "
            "error (default %(default)s, lowered to fit the file descriptor limit)",
        )
        p.add_argument(
            "--idle-timeout-s",
            type=_positive,
            default=NodeConfig.idle_timeout_s,
            help="close a data connection that carried no request for this long "
            "(default %(default)s)",
        )
        p.add_argument(
            "--header-timeout-s",
            type=_positive,
            default=NodeConfig.header_timeout_s,
            help="a frame header must arrive whole within this long of its first byte "
            "(default %(default)s)",
        )

    serve = sub.add_parser("serve", help="master + one node in one process")
    common(serve, 9400)
    master_flags(serve)
    node_flags(serve)
    master = sub.add_parser("master", help="the control plane only")
    common(master, 9400)
    master_flags(master)
    master.add_argument(
        "--redis",
        metavar="URL",
        help="keep the index in Redis (redis://host:port/db) instead of this process",
    )
    node = sub.add_parser("node", help="one storage node")
    common(node, 9401)
    node_flags(node)
    node.add_argument("--master", required=True, help="HOST:PORT of the master")
    return parser


async def _run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics = Metrics()
    exits = contextlib.AsyncExitStack()
    async with exits:
        parts: list[str] = []
        node: StorageNode | None = None
        if args.command in ("serve", "master"):
            private = args.command == "serve"
            mcfg = MasterConfig(
                host="127.0.0.1" if private else args.host,
                grpc_port=0 if private else args.grpc_port,
                node_lease_s=args.node_lease_s,
            )
            store = None
            if getattr(args, "redis", None):
                store = RedisIndexStore(args.redis)
                await store.start()
                exits.push_async_callback(store.close)
            master = MasterServer(mcfg, store)
            master.service.add_rpc_observer(
                lambda method, seconds: metrics.rpc_seconds.labels(method=method).observe(seconds)
            )
            _wire_master_counters(master, metrics)
            await master.start()
            exits.push_async_callback(master.stop, 5.0)
            master_addr = master.address
            if not private:
                parts.append(f"grpc={master.address}")
        if args.command in ("serve", "node"):
            target = master_addr if args.command == "serve" else args.master
            node = StorageNode(
                NodeConfig(
                    master=target,
                    host=args.host,
                    data_port=args.data_port,
                    node_id=args.node_id,
                    host_mem=args.host_mem,
                    gpu_mem=args.gpu_mem,
                    transport=args.transport,
                    io_timeout_s=args.io_timeout_s,
                    max_connections=args.max_connections,
                    idle_timeout_s=args.idle_timeout_s,
                    header_timeout_s=args.header_timeout_s,
                ),
                metrics,
                # serve: the node commits straight to its in-process master, not over gRPC.
                master=MasterClient.in_process(master.service) if args.command == "serve" else None,
            )
            await node.start()
            exits.push_async_callback(node.stop, 5.0)
        if args.command == "serve":
            port = await master.listen(args.host, args.grpc_port)
            parts.append(f"grpc={grpc_address(args.host, port)}")
        if node is not None:
            parts.append(f"data={node.data_uri}")
            parts.append(f"node={node.node_id}")
        msrv = MetricsServer(metrics, args.host, args.metrics_port)
        exits.callback(msrv.close)
        parts.append(f"metrics={msrv.address}")
        print(f"kvstore ready {' '.join(parts)}", flush=True)
        await stop.wait()
        log.info("stopping")
    pins = node.pinned_slots if node is not None else 0
    print(f"kvstore stopped pinned_slots={pins}", flush=True)
    return 0


def _wire_master_counters(master: MasterServer, metrics: Metrics) -> None:
    """Export the master's prefix counters as the Prometheus metrics it owns."""
    counters = master.service.counters

    class _PrefixCollector(Collector):
        def collect(self) -> Iterator[Metric]:
            lookups = CounterMetricFamily(
                "kvstore_prefix_lookups", "match_prefix calls served by the master"
            )
            lookups.add_metric([], counters.prefix_lookups)
            tokens = CounterMetricFamily(
                "kvstore_prefix_hit_tokens", "Tokens matched by match_prefix"
            )
            tokens.add_metric([], counters.hit_tokens)
            yield lookups
            yield tokens

    metrics.registry.register(_PrefixCollector())


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return asyncio.run(_run(args))
    except KVStoreError as exc:
        print(f"kvstore {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except OSError as exc:
        print(f"kvstore {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())

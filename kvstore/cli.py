"""``kvstore serve | master | node | config``: thin entry points over the library.

Each server command resolves its settings (flags > ``KVSTORE_*`` environment > ``--config``
TOML file > defaults, :mod:`kvstore.config`), starts its servers in one event loop and
prints one flushed line containing ``kvstore ready`` and its addresses once it can serve.
``kvstore config [serve|master|node] [FLAGS]`` prints the effective configuration as TOML,
each value commented with where it came from, and starts nothing.

Errors: a bad flag, variable or file value exits 2 with one line on stderr, answered before
torch, grpc or the servers are imported (this module imports argparse and
:mod:`kvstore.config` only; the servers come with :func:`_run`). A port that cannot be bound
or a master that cannot be reached exits 1 with one line: each port is probed before the
servers start, so gRPC's own log line about a taken port does not come first. SIGTERM (or
SIGINT) stops accepting, lets exchanges in flight finish, deregisters the node (its entries
go at once), stops the gRPC server with a grace period and exits 0; a node with
``--drain-on-exit S`` first copies its blocks to other nodes for at most S seconds.

``serve`` runs a master and one node in one process: the node registers and commits by
calling the master's handlers directly (``MasterClient.in_process``; its heartbeats use a
private loopback gRPC port), and only then is the public ``--grpc-port`` opened, so a
client that reaches it always finds a node.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvstore import __version__
from kvstore.config import (
    COMMANDS,
    CONFIG_ENV,
    PORT_SETTINGS,
    Resolved,
    Setting,
    render_toml,
    resolve,
    settings_for,
)
from kvstore.errors import InvalidArgument, KVStoreError

if TYPE_CHECKING:
    import asyncio

    from kvstore.control.auth import AuthConfig
    from kvstore.control.tls import TlsFiles
    from kvstore.master.server import MasterServer
    from kvstore.master.service import PoolState
    from kvstore.metrics import Metrics
    from kvstore.node.server import StorageNode

__all__ = ["EXIT_RUNTIME", "EXIT_USAGE", "build_parser", "configure", "main"]

EXIT_USAGE = 2
"""A bad flag, environment variable or config file value; nothing was started."""
EXIT_RUNTIME = 1
"""A port could not be bound, the master could not be reached, or a server failed."""

_HELP = {
    "serve": "master + one node in one process",
    "master": "the control plane only",
    "node": "one storage node",
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _argtype(setting: Setting) -> Callable[[str], object]:
    def parse(text: str) -> object:
        try:
            return setting.parse(text)
        except InvalidArgument as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parse.__name__ = setting.name  # argparse names it in "invalid <name> value"
    return parse


def _add_settings(parser: argparse.ArgumentParser, command: str) -> None:
    """One flag per setting of ``command``, each with its default and variable in its help;
    flags default to nothing so that only the given ones take precedence."""
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help=f"a TOML file of settings: keys as the flags without --, a [{command}] table "
        f"over the top level (default: none; env {CONFIG_ENV})",
    )
    for s in settings_for(command):
        default = s.shown(s.default_for(command))
        required = " (required)" if command in s.required else ""
        if s.switch:  # --insecure: no value
            parser.add_argument(s.flag, dest=s.dest, action="store_const", const=True,
                                default=argparse.SUPPRESS,
                                help=f"{s.help} (default: {default}; env {s.env}=1)")  # fmt: skip
            continue
        parser.add_argument(
            s.flag,
            dest=s.dest,
            metavar=s.metavar or None,
            type=_argtype(s),
            default=argparse.SUPPRESS,
            help=f"{s.help}{required} (default: {default}; env {s.env})",
        )


def build_parser() -> argparse.ArgumentParser:
    """The ``kvstore`` argument parser: one subcommand per process kind, plus ``config``.
    Parsing imports nothing heavy; values are parsed and checked by :mod:`kvstore.config`."""
    parser = _Parser(
        prog="kvstore",
        description="KV-cache pool for disaggregated inference. Settings: flags > "
        "KVSTORE_* environment > --config TOML file > defaults.",
        epilog="exit codes: 0 stopped cleanly, 1 a port or the master failed, 2 usage error",
    )
    parser.add_argument("--version", action="version", version=f"kvstore {__version__}")
    [log_level] = [s for s in settings_for("serve") if s.name == "log-level"]
    parser.add_argument(
        "--log-level",
        metavar=log_level.metavar,
        type=_argtype(log_level),
        default=argparse.SUPPRESS,
        help="as each command's --log-level, which wins (kept for `kvstore --log-level L "
        f"serve`) (default: {log_level.shown(log_level.default_for('serve'))}; env "
        f"{log_level.env})",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        p = sub.add_parser(command, help=_HELP[command], description=_HELP[command])
        _add_settings(p, command)
    config = sub.add_parser(
        "config",
        help="print the effective configuration of a command (TOML) and where each value came from",
        description="Print the effective configuration of `kvstore COMMAND` (default: serve) "
        "with these flags, environment and config file, as TOML that --config reads back; "
        "starts nothing.",
    )
    targets = config.add_subparsers(dest="target", parser_class=_Parser, metavar="COMMAND")
    for command in COMMANDS:
        _add_settings(targets.add_parser(command, help=f"settings of `kvstore {command}`"), command)
    return parser


def configure(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[str, Resolved]:
    """Parse ``argv`` and resolve the settings against ``environ`` (default the process's):
    returns (``"serve" | "master" | "node" | "config"``, the effective configuration).
    Raises SystemExit(2) with one line on stderr for any bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = dict(vars(args))
    command = given.pop("command")
    target = command
    if command == "config":
        target = given.pop("target", None) or "serve"
    config_file = given.pop("config", None)
    try:
        resolved = resolve(target, given, os.environ if environ is None else environ, config_file)
    except InvalidArgument as exc:
        parser.exit(EXIT_USAGE, f"kvstore {command}: error: {exc}\n")
    return command, resolved


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    command, cfg = configure(argv)
    if command == "config":
        sys.stdout.write(render_toml(cfg))
        return 0
    try:
        auth = _check_exposure(cfg)
        tls = _load_tls(cfg)
    except InvalidArgument as exc:
        print(f"kvstore {command}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    try:
        _probe_ports(cfg)
    except OSError as exc:
        print(f"kvstore {command}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_RUNTIME
    import asyncio
    import logging

    logging.basicConfig(
        level=getattr(logging, cfg["log_level"]),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return asyncio.run(_run(cfg, auth, tls))
    except (KVStoreError, OSError) as exc:
        print(f"kvstore {command}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_RUNTIME


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _check_exposure(cfg: Resolved) -> AuthConfig | None:
    """Refuse to serve a non-loopback address with no auth file, unless ``--insecure``:
    anyone who reaches an open port may read, forge or evict KV. Returns the loaded auth
    file (None without one), so that a bad one fails here, in one line."""
    if cfg.values.get("auth_file"):
        from kvstore.control.auth import AuthConfig

        return AuthConfig.load(cfg["auth_file"])
    if not _is_loopback(cfg["host"]) and not cfg["insecure"]:
        raise InvalidArgument(
            f"--host {cfg['host']} is not a loopback address and no --auth-file is given: "
            "anyone reaching the ports could read, forge or evict KV; give --auth-file "
            "(docs/security.md), or --insecure on a network you trust"
        )
    return None


def _load_tls(cfg: Resolved) -> tuple[Any, TlsFiles | None, Any, Any]:
    """The master's gRPC server credentials (None: plaintext), the node's TLS files toward
    its master (None: not a node), the data port's server context (None: ``tcp://``) and
    the master's commit port's (None: ``tcp://``), read here so that a bad file fails in
    one line."""
    from dataclasses import replace

    from kvstore.control.tls import TlsFiles, channel_credentials, server_credentials

    def path(name: str) -> str:
        return str(cfg.values.get(name) or "")

    mine = TlsFiles(path("tls_cert"), path("tls_key"))
    if cfg.command in ("serve", "master") and path("tls_client_ca") and not mine.on:
        raise InvalidArgument(
            "--tls-client-ca needs --tls-cert and --tls-key: client certificates are asked "
            "for in a TLS handshake, and without a certificate the port is plaintext"
        )
    server_tls = commit_tls = None
    if cfg.command in ("serve", "master") and mine.on:
        server_tls = server_credentials(replace(mine, ca=path("tls_client_ca")))
    if cfg.command == "master" and mine.on:
        from kvstore.transport.tls import server_context

        # the commit port: the same certificate, and the same client CA if any
        commit_tls = server_context(mine.cert, mine.key, path("tls_client_ca"))
    node_tls = replace(mine, ca=path("tls_ca")) if cfg.command == "node" else None
    if node_tls is not None and node_tls.on:
        channel_credentials(node_tls)  # (reads and checks the files)
    data_tls = None
    if cfg.command in ("serve", "node") and cfg.values.get("data_tls"):
        from kvstore.transport.tls import server_context

        if not mine.cert:
            raise InvalidArgument("--data-tls needs --tls-cert and --tls-key")
        server_credentials(mine)  # (the same checks of the files: key mode, PEM)
        data_tls = server_context(mine.cert, mine.key)
    if mine.cert and mine.key:
        from kvstore.transport.tls import check_certificate

        # Expired or not yet valid: refused here, not at each client's handshake. Not
        # naming the address the ports are on: said, since clients may dial a name it has.
        serves = cfg.command in ("serve", "master") or bool(cfg.values.get("data_tls"))
        warning = check_certificate(mine.cert, mine.key, cfg["host"] if serves else "")
        if warning:
            print(f"kvstore {cfg.command}: warning: {warning}", file=sys.stderr, flush=True)
    return server_tls, node_tls, data_tls, commit_tls


def _probe_ports(cfg: Resolved) -> None:
    """Bind and release each fixed port this command will open (as the servers do, with
    SO_REUSEADDR), so that a taken port is reported in one line of ours before any server
    starts — gRPC logs its own line before it fails. Raises OSError naming the port."""
    for dest, what in PORT_SETTINGS.items():
        port = cfg.values.get(dest)
        if not isinstance(port, int) or port == 0:
            continue
        address = f"{cfg['host']}:{port}"
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(
                cfg["host"], port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            flag = "--" + dest.replace("_", "-")
            raise OSError(f"cannot bind the {what} port {address} ({flag}): {reason}") from exc


async def _run(
    cfg: Resolved, auth: AuthConfig | None, tls: tuple[Any, TlsFiles | None, Any, Any]
) -> int:
    import asyncio
    import contextlib
    import logging
    import signal

    from kvstore.control.client import MasterClient
    from kvstore.master.redis_store import RedisIndexStore
    from kvstore.master.server import MasterConfig, MasterServer, grpc_address
    from kvstore.metrics import Metrics, MetricsServer

    command = cfg.command
    secret = auth.cluster_secret if auth is not None else ""

    server_tls, node_tls, data_tls, commit_tls = tls
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics = Metrics()
    if command == "master":
        metrics.master_only()
    elif command == "node":
        metrics.node_only()
    exits = contextlib.AsyncExitStack()
    async with exits:
        parts: list[str] = []
        node: StorageNode | None = None
        if command in ("serve", "master"):
            private = command == "serve"
            commit_port = None if private else cfg["commit_port"]
            mcfg = MasterConfig(
                host="127.0.0.1" if private else cfg["host"],
                grpc_port=0 if private else cfg["grpc_port"],
                # serve: its node commits in-process; nothing else commits there
                commit_port=None if commit_port == "off" else commit_port,
                node_lease_s=cfg["node_lease_s"],
            )
            store = None
            if cfg.values.get("redis"):
                store = RedisIndexStore(cfg["redis"])
                await store.start()
                exits.push_async_callback(store.close)
            # serve: its private loopback port stays plaintext (its own node), the public
            # one (listen below) speaks TLS
            master = MasterServer(
                mcfg, store, auth=auth, tls=None if private else server_tls, commit_tls=commit_tls
            )
            master.service.add_rpc_observer(metrics.observe_rpc)
            _wire_master_counters(master, metrics)
            await master.start()
            exits.push_async_callback(master.stop, 5.0)
            if not private:
                parts.append(f"grpc={master.address}")
                if master.commits is not None:
                    scheme = "tls" if commit_tls is not None else "tcp"
                    host = grpc_address(cfg["host"], master.commits.port)
                    parts.append(f"commit={scheme}://{host}")
        if command in ("serve", "node"):
            # (here, not above: a master alone never loads the node, nor torch: ~2 s)
            from kvstore.node.server import NodeConfig, StorageNode

            node = StorageNode(
                NodeConfig(
                    master=master.address if command == "serve" else cfg["master"],
                    host=cfg["host"],
                    data_port=cfg["data_port"],
                    node_id=cfg["node_id"],
                    host_mem=cfg["host_mem"],
                    prefault_memory=cfg["prefault_memory"],
                    huge_pages=cfg["huge_pages"],
                    gpu_mem=cfg["gpu_mem"],
                    disk_path=cfg["disk_path"] or "",
                    disk_size=cfg["disk_size"],
                    disk_compress=cfg["disk_compress"],
                    transport=cfg["transport"],
                    io_timeout_s=cfg["io_timeout_s"],
                    max_connections=cfg["max_connections"],
                    idle_timeout_s=cfg["idle_timeout_s"],
                    header_timeout_s=cfg["header_timeout_s"],
                    token=secret,
                    tls=node_tls,
                    data_tls=data_tls,
                ),
                metrics,
                # serve: the node commits straight to its in-process master, not over gRPC.
                master=(
                    MasterClient.in_process(master.service, token=secret)
                    if command == "serve"
                    else None
                ),
            )
            exits.push_async_callback(node.stop, 5.0)  # (also what a start cut short opened)
            if not await _unless_stopped(node.start(), stop):
                logging.getLogger("kvstore").info("stopped before it was ready")
                print("kvstore stopped pinned_slots=0", flush=True)
                return 0
        if command == "serve":
            port = await master.listen(cfg["host"], cfg["grpc_port"], server_tls)
            parts.append(f"grpc={grpc_address(cfg['host'], port)}")
        if node is not None:
            parts.append(f"data={node.data_uri}")
            if cfg["transport"] == "ucx":
                parts.append(f"ucx={await _ucx_uri(node)}")
            parts.append(f"node={node.node_id}")
        parts.append("auth=" + ("on" if auth is not None else "off"))
        if server_tls is not None or (node_tls is not None and node_tls.on):
            parts.append("tls=on")
        msrv = MetricsServer(metrics, cfg["host"], cfg["metrics_port"])
        exits.callback(msrv.close)
        parts.append(f"metrics={msrv.address}")
        _freeze_startup_objects()
        print(f"kvstore ready {' '.join(parts)}", flush=True)
        await stop.wait()
        logging.getLogger("kvstore").info("stopping")
        if node is not None and cfg.values.get("drain_on_exit"):
            done = await node.drain_and_wait(cfg["drain_on_exit"])
            moved, left = done["drain_moved_chunks"], done["drain_left"]
            print(f"kvstore drained state={done['drain_state']} moved_chunks={moved} "
                  f"left={left} failed={done['drain_failed']}", flush=True)  # fmt: skip
    pins = node.pinned_slots if node is not None else 0
    print(f"kvstore stopped pinned_slots={pins}", flush=True)
    return 0


async def _unless_stopped(starting: Awaitable[None], stop: asyncio.Event) -> bool:
    """Await ``starting`` unless ``stop`` is set first (SIGTERM or SIGINT while a node still
    waits for its master, which it retries for a minute): then cancel it; whether it ran to
    its end. Raises what ``starting`` raised."""
    import asyncio

    task = asyncio.ensure_future(starting)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=10.0)
        return False
    task.result()
    return True


def _freeze_startup_objects() -> None:
    """Move every object alive once the process is ready (modules, torch's, the pool's
    tables: ~200,000 here) out of the cyclic collector's reach, after one collection.

    Measured on a node taking 8 x 512 KiB puts: each full collection walked all of them,
    pausing whatever put was in flight for 162-174 ms; with them frozen a full collection
    took 16 ms, walking the ~33,000 objects made since (docs/decisions.md).
    """
    import gc

    gc.collect()
    gc.freeze()


async def _ucx_uri(node: StorageNode) -> str:
    """``ucx://HOST/AGENT``: the NIXL agent this node registered with the master (what
    clients load from ``Nodes()`` to READ and WRITE its slots one-sidedly)."""
    from kvstore.transport.nixl_binding import agent_name_of

    [me] = [n for n in await node.link.master.nodes() if n.node_id == node.node_id]
    return f"ucx://{me.host or node.config.host}/{agent_name_of(me.nixl_metadata) or '?'}"


def _wire_master_counters(master: MasterServer, metrics: Metrics) -> None:
    """Export the master's prefix and commit-port counters as the Prometheus metrics it
    owns."""
    from collections.abc import Iterator

    from prometheus_client.core import CounterMetricFamily, Metric
    from prometheus_client.registry import Collector

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
            missed = CounterMetricFamily(
                "kvstore_prefix_miss_tokens", "Tokens of match_prefix requests not matched"
            )
            missed.add_metric([], counters.miss_tokens)
            links = CounterMetricFamily(
                "kvstore_commit_links",
                "Connections to the master's commit port that sent a commit (a node keeps "
                "one; more: its reconnects)",
            )
            links.add_metric([], counters.commit_links)
            yield lookups
            yield tokens
            yield missed
            yield links

    metrics.registry.register(_PrefixCollector())

    def on_sweep(state: PoolState) -> None:
        for name, n in state.nodes.items():
            metrics.nodes.labels(state=name).set(n)
        metrics.blocks.labels(role="master").set(state.blocks)

    master.service.add_pool_observer(on_sweep)


def entry() -> None:
    """The ``kvstore`` command: :func:`main`, its status the process's."""
    sys.exit(main())


if __name__ == "__main__":
    entry()

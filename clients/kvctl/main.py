"""``kvctl``: the operators' admin CLI for a kvstore master (docs/architecture.md, "Admin CLI").

::

    kvctl [--master HOST:PORT] [--timeout S] COMMAND [--json]
        status              pool totals (Stats)
        nodes               every node: liveness, lease, epoch, transport, tiers (Nodes)
        stats               the master's counters and per-tier usage (Stats + Nodes)
        lookup ...          why a prompt does or does not match, block by block
                            (Lookup + MatchPrefix + Nodes)
        drain NODE          mark a node draining, ``--undrain`` clears the mark (Drain);
                            ``--wait``: then wait until the node has copied its blocks
                            to other nodes (Nodes, then the node's data port)
        top                 a live view of nodes, tiers, hit ratio, transfer rates and
                            evictions, redrawn every second; ``--once`` prints one
                            snapshot (Stats + Nodes, and each ``--metrics`` endpoint's
                            /metrics: see :mod:`kvctl.top`)

``kvctl --version`` prints the package version. ``--master`` defaults to
``$KVSTORE_MASTER`` or ``127.0.0.1:50051``; ``--master``, ``--timeout`` and
``--token-file`` (a master with an auth file: the operator's token; default
``$KVSTORE_TOKEN``, else the file ``$KVSTORE_TOKEN_FILE`` names), ``--ca-file`` (a master
with TLS: the CA its certificate chains to; default ``$KVSTORE_TLS_CA``), ``--cert-file``
and ``--key-file`` (a master that requires client certificates; default
``$KVSTORE_TLS_CERT``, ``$KVSTORE_TLS_KEY``) may also follow the command. ``--json``
prints one JSON document instead of a table. Exit codes: 0 ok, 1 the master could not be
reached or answered with an error (one line on stderr), 2 usage errors (bad flags, tokens,
namespace).

        evict ...           evict a prompt's blocks, or a whole namespace without tokens,
                            on every live node (Nodes, then each node's data port: nodes
                            are the only writers of their index entries and commit the
                            evictions to the master before they answer)

Cold start is kept small: this module imports argparse and ``kvstore.errors`` only; grpc
comes with the first master call, rich with the first table, numpy with ``lookup``; torch
and NIXL never.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TextIO, TypeVar

from kvstore.errors import InvalidArgument, KVStoreError, KVTimeout, Unreachable

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

    from kvstore.control.client import MasterClient
    from kvstore.control.tls import TlsFiles

__all__ = ["DEFAULT_MASTER", "DEFAULT_TIMEOUT_S", "EXIT_MASTER", "EXIT_USAGE", "main"]

DEFAULT_MASTER = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 5.0
EXIT_OK = 0
EXIT_MASTER = 1
"""The master could not be reached, timed out or answered with an error."""
EXIT_USAGE = 2
"""Bad flags or input; nothing was sent."""
_EXIT_INTERRUPTED = 130

T = TypeVar("T")


@dataclass(frozen=True)
class _Job(Generic[T]):
    """One subcommand's work: what to ask the master and how to print the answer."""

    fetch: Callable[[MasterClient], Awaitable[T]]
    to_json: Callable[[T], dict[str, Any]]
    to_table: Callable[[T, TextIO], None]
    failed: Callable[[T], bool] = lambda result: False
    """Whether the answer, printed in full, says that nothing was done (exit 1)."""


def main(
    argv: Sequence[str] | None = None,
    *,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run ``kvctl`` with ``argv`` (default ``sys.argv[1:]``) and return its exit code.

    Blocks until the master answered (each RPC waits at most ``--timeout``). Streams
    default to ``sys.stdin``/``sys.stdout``/``sys.stderr``. Never raises for a master,
    usage or input error: those are the exit codes 1 and 2 with one line on ``stderr``.
    """
    # The library's own warnings (a master down, the next one tried) are not this tool's
    # output, while it runs: an error ends in its one line on ``stderr``. gRPC's core logs
    # to stderr itself (a failed TLS handshake: a line of its own before ours); the reason
    # is in our line (set before grpc is imported, where it is read; a user's value stands).
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    library = logging.getLogger("kvstore")
    level = library.level
    library.setLevel(logging.ERROR)
    try:
        return _main(argv, stdin, stdout, stderr)
    finally:
        library.setLevel(level)


def _main(
    argv: Sequence[str] | None,
    stdin: TextIO | None,
    stdout: TextIO | None,
    stderr: TextIO | None,
) -> int:
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    parser = build_parser(out, err, os.environ.get("KVSTORE_MASTER") or DEFAULT_MASTER)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command == "top":
        return _top(args, out, err)
    try:
        job = args.prepare(args, sys.stdin if stdin is None else stdin)
        token, tls = _token(args), _tls(args)
    except InvalidArgument as exc:
        err.write(f"kvctl: {exc}\n")
        return EXIT_USAGE
    try:
        result = _ask_master(args.master, args.timeout, job.fetch, token, tls)
    except KVStoreError as exc:
        err.write(_describe(exc, args.master, args.timeout, tls) + "\n")
        return EXIT_MASTER
    except KeyboardInterrupt:
        return _EXIT_INTERRUPTED
    if args.json:
        import json

        json.dump(job.to_json(result), out, indent=2)
        out.write("\n")
    else:
        job.to_table(result, out)
    return EXIT_MASTER if job.failed(result) else EXIT_OK


def _top(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``kvctl top``: 0 after ``--once`` or Ctrl-C, 1 when the first snapshot fails."""
    from kvctl import top

    if args.json and not args.once:
        err.write("kvctl top: --json needs --once\n")
        return EXIT_USAGE
    try:
        token, tls = _token(args), _tls(args)
    except InvalidArgument as exc:
        err.write(f"kvctl: {exc}\n")
        return EXIT_USAGE
    opts = top.TopOptions(
        token=token,
        tls=tls,
        master=args.master,
        timeout_s=args.timeout,
        interval_s=args.interval,
        once=args.once,
        json=args.json,
        metrics=tuple(args.metrics),
        node_metrics_port=args.node_metrics_port,
    )
    try:
        top.run(opts, out)
    except KVStoreError as exc:
        err.write(_describe(exc, args.master, args.timeout, tls) + "\n")
        return EXIT_MASTER
    except KeyboardInterrupt:
        return EXIT_OK  # how the live view is left
    return EXIT_OK


def _token(args: argparse.Namespace) -> str:
    """``--token-file``'s token, else ``$KVSTORE_TOKEN`` / ``$KVSTORE_TOKEN_FILE``'s, else
    none. Raises InvalidArgument for a file that cannot be read."""
    from kvstore.control.auth import read_token_file, token_from_env

    path = getattr(args, "token_file", None)
    return read_token_file(path) if path else token_from_env()


def _tls(args: argparse.Namespace) -> TlsFiles:
    """``--ca-file``, ``--cert-file``, ``--key-file``, each defaulting to its
    ``$KVSTORE_TLS_*`` variable; nothing set: plaintext."""
    from kvstore.control.tls import channel_credentials, tls_from_env

    files = tls_from_env(
        cert=getattr(args, "cert_file", None),
        key=getattr(args, "key_file", None),
        ca=getattr(args, "ca_file", None),
    )
    if files.on:
        channel_credentials(files)  # (reads and checks them: a bad file is a usage error)
    return files


def _ask_master(
    target: str,
    timeout_s: float,
    fetch: Callable[[MasterClient], Awaitable[T]],
    token: str = "",
    tls: TlsFiles | None = None,
) -> T:
    import asyncio

    return asyncio.run(_with_client(target, timeout_s, fetch, token, tls))


async def _with_client(
    target: str,
    timeout_s: float,
    fetch: Callable[[MasterClient], Awaitable[T]],
    token: str,
    tls: TlsFiles | None,
) -> T:
    from kvstore.control.client import MasterClient

    async with MasterClient(target, timeout_s=timeout_s, token=token, tls=tls) as client:
        return await fetch(client)


def _describe(exc: KVStoreError, target: str, timeout_s: float, tls: TlsFiles | None = None) -> str:
    """The one stderr line for a failed master call."""
    if isinstance(exc, Unreachable):
        why = unreachable_reason(str(exc), tls)
        return f"kvctl: cannot reach master at {target} (unavailable{': ' + why if why else ''})"
    from kvctl.commands import WaitTimeout

    if isinstance(exc, KVTimeout) and not isinstance(exc, WaitTimeout):
        return (
            f"kvctl: master at {target} did not answer within {timeout_s:g} s (deadline exceeded)"
        )
    return f"kvctl: {exc}"


def unreachable_reason(message: str, tls: TlsFiles | None) -> str:
    """Why gRPC could not reach a master, in an operator's words, from the error's message
    (gRPC's own text: "failed to connect to all addresses; last error: ..."); empty when
    it names no reason. ``tls``: the files kvctl spoke TLS with (none: plaintext). A
    master that answered UNAVAILABLE itself (its Redis down) has its reason said."""
    if "last error: " not in message:  # (no connection failure: the master answered so)
        said = message.partition(": ")[2].removesuffix(" (UNAVAILABLE)").strip()
        return f"the master answered: {said}" if said else ""
    last = message.rpartition("last error: ")[2]
    if "Connection refused" in last:
        return "connection refused: nothing listens there"
    if "Hostname Verification Check failed" in last:
        return "TLS: the master's certificate does not name the address given"
    if "CERTIFICATE_VERIFY_FAILED" in last:
        detail = last.partition("CERTIFICATE_VERIFY_FAILED: ")[2].partition(": OK")[0]
        said = f": {detail.strip()}" if detail.strip() else ""
        return f"TLS: the master's certificate did not verify against the CA given{said}"
    if "WRONG_VERSION_NUMBER" in last:
        return "TLS: the master does not speak TLS there (leave out --ca-file)"
    if "Socket closed" in last:
        if tls is None or not tls.on:
            return "the master hung up; one serving TLS does so to plaintext (give --ca-file)"
        if not tls.cert:
            return (
                "the master hung up in the TLS handshake; one that requires client "
                "certificates does so without one (give --cert-file, --key-file)"
            )
        return "the master hung up in the TLS handshake"
    if "handshake failed" in last.lower():
        return "TLS handshake failed: " + last.rpartition("): ")[2].strip()
    return ""


# -- jobs: parse the command's input (InvalidArgument -> exit 2), nothing sent yet -----------


def _status_job(args: argparse.Namespace, stdin: TextIO) -> _Job[Any]:
    from kvctl import commands, tables

    return _Job(commands.fetch_status, commands.status_json, tables.print_status)


def _nodes_job(args: argparse.Namespace, stdin: TextIO) -> _Job[Any]:
    from kvctl import commands, tables

    return _Job(commands.fetch_nodes, commands.nodes_json, tables.print_nodes)


def _stats_job(args: argparse.Namespace, stdin: TextIO) -> _Job[Any]:
    from kvctl import commands, tables

    return _Job(commands.fetch_stats, commands.stats_json, tables.print_stats)


def _drain_job(args: argparse.Namespace, stdin: TextIO) -> _Job[Any]:
    from kvctl import commands, tables

    node_id, undrain, timeout_s = args.node, args.undrain, args.timeout
    wait_s = args.wait_s if args.wait else 0.0
    if not node_id:
        raise InvalidArgument("drain: NODE must not be empty")
    if undrain and args.wait:
        raise InvalidArgument("drain: --wait goes with a drain, not --undrain")

    def fetch(client: MasterClient) -> Awaitable[commands.DrainResult]:
        return commands.drain(client, node_id, undrain=undrain, wait_s=wait_s,
                              timeout_s=timeout_s)  # fmt: skip

    return _Job(fetch, commands.drain_json, tables.print_drain)


def _namespace(args: argparse.Namespace) -> Any:
    from kvstore.core.hashing import Namespace

    return Namespace(
        model=args.model,
        revision=args.revision,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        block_tokens=args.block_tokens,
        quant=args.quant,
        adapter=args.adapter,
        cache_salt=args.cache_salt,
        tp_size=args.tp_size,
    )


def _tokens(args: argparse.Namespace, stdin: TextIO) -> list[int] | None:
    from kvctl import commands

    if args.tokens is not None:
        return commands.parse_tokens(args.tokens)
    if args.tokens_file is not None:
        return commands.read_tokens(args.tokens_file, stdin)
    return None


def _lookup_job(args: argparse.Namespace, stdin: TextIO) -> _Job[Any]:
    from kvctl import commands, explain, tables

    tokens = _tokens(args, stdin)
    if tokens is None:
        raise InvalidArgument("lookup needs --tokens or --tokens-file")
    plan = commands.plan_lookup(_namespace(args), tokens)

    def fetch(client: MasterClient) -> Awaitable[explain.PrefixReport]:
        return commands.fetch_lookup(client, plan)

    return _Job(fetch, explain.report_json, tables.print_lookup)


def _evict_job(args: argparse.Namespace, stdin: TextIO) -> _Job[Any]:
    from kvctl import commands, tables

    ns = _namespace(args)
    tokens = _tokens(args, stdin)
    blocks = None if tokens is None else commands.plan_lookup(ns, tokens).block_hashes
    timeout_s = args.timeout

    def fetch(client: MasterClient) -> Awaitable[commands.EvictResult]:
        return commands.evict(client, ns.id, blocks, timeout_s, args.tenant)

    def refused(result: commands.EvictResult) -> bool:  # (every node answered an error)
        return bool(result.nodes) and all(n.error for n in result.nodes)

    return _Job(fetch, commands.evict_json, tables.print_evict, refused)


# -- the parser -----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse writing to the given streams; exits by raising SystemExit (main catches)."""

    def __init__(self, *args: Any, out: TextIO, err: TextIO, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._out = out
        self._err = err

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        super().print_help(self._out if file is None else file)

    def print_usage(self, file: SupportsWrite[str] | None = None) -> None:
        super().print_usage(self._out if file is None else file)

    def write_out(self, text: str) -> None:
        """Write ``text`` to the parser's output stream."""
        self._out.write(text)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            self._err.write(message)
        raise SystemExit(status)

    def error(self, message: str) -> NoReturn:
        self.print_usage(self._err)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from exc
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from exc
    if not 0 < port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} outside 1..65535")
    return port


class _Version(argparse.Action):
    """``--version``: print ``kvctl VERSION`` to the parser's output and exit 0."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print the version and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from kvstore import __version__

        line = f"kvctl {__version__}\n"
        if isinstance(parser, _Parser):
            parser.write_out(line)
        else:
            sys.stdout.write(line)
        raise SystemExit(EXIT_OK)


def _address(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the master address must not be empty")
    return text.strip()


def _connection_options(parser: argparse.ArgumentParser, master: str | None) -> None:
    """``--master``/``--timeout``; on subcommands (``master`` None) without defaults, so
    they override the top level's only when given."""
    suppress = argparse.SUPPRESS
    parser.add_argument(
        "--master",
        type=_address,
        default=suppress if master is None else master,
        metavar="HOST:PORT",
        help=f"the master's gRPC address (default: $KVSTORE_MASTER or {DEFAULT_MASTER})",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=suppress if master is None else DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"deadline of each master call in seconds (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--token-file",
        default=suppress if master is None else None,
        metavar="PATH",
        help="a file holding this operator's token, for a master with an auth file "
        "(default: $KVSTORE_TOKEN, else the file $KVSTORE_TOKEN_FILE names)",
    )
    for flag, what, env in (
        ("--ca-file", "the CA a TLS master's certificate chains to", "KVSTORE_TLS_CA"),
        ("--cert-file", "this operator's client certificate (mutual TLS)", "KVSTORE_TLS_CERT"),
        ("--key-file", "the private key of --cert-file", "KVSTORE_TLS_KEY"),
    ):
        parser.add_argument(
            flag,
            default=suppress if master is None else None,
            metavar="PATH",
            help=f"{what} (default: ${env})",
        )


def _lookup_options(parser: argparse.ArgumentParser, tokens_required: bool = True) -> None:
    ns = parser.add_argument_group("namespace (must match the engine's exactly)")
    ns.add_argument("--model", required=True)
    ns.add_argument("--revision", required=True)
    ns.add_argument("--layers", type=int, required=True, help="num_layers")
    ns.add_argument("--kv-heads", type=int, required=True, help="KV heads per TP shard")
    ns.add_argument("--head-dim", type=int, required=True)
    ns.add_argument("--dtype", default="bfloat16", help="float16 | bfloat16 | float32")
    ns.add_argument("--block-tokens", type=int, default=256)
    ns.add_argument("--quant", default="int8", help="int8, int4, none or a scheme name")
    ns.add_argument("--tp-size", type=int, default=1)
    ns.add_argument("--adapter", default=None, help="LoRA id (default none)")
    ns.add_argument("--cache-salt", default=None, help="tenant salt (default none)")
    prompt = parser.add_argument_group("the prompt")
    tokens = prompt.add_mutually_exclusive_group(required=tokens_required)
    tokens.add_argument("--tokens", metavar="1,2,3,...", help="token ids, comma-separated")
    tokens.add_argument(
        "--tokens-file",
        metavar="FILE",
        help="a JSON list or whitespace-separated token ids; - reads stdin",
    )


def build_parser(out: TextIO, err: TextIO, default_master: str = DEFAULT_MASTER) -> _Parser:
    """The ``kvctl`` argument parser; help goes to ``out``, usage errors to ``err``."""
    parser = _Parser(
        prog="kvctl",
        description="Admin CLI of a kvstore master.",
        epilog="exit codes: 0 ok, 1 master unreachable or error, 2 usage error",
        out=out,
        err=err,
    )
    parser.add_argument("--version", action=_Version)
    _connection_options(parser, default_master)
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands: list[tuple[str, str, Callable[[argparse.Namespace, TextIO], _Job[Any]]]] = [
        ("status", "pool totals", _status_job),
        ("nodes", "every node: state, lease, epoch, transport, tiers", _nodes_job),
        ("stats", "the master's counters and per-tier usage", _stats_job),
        ("lookup", "why a prompt does or does not match, block by block", _lookup_job),
        (
            "drain",
            "mark a node draining: no new placements, its blocks are copied away",
            _drain_job,
        ),
        ("evict", "evict a prompt's blocks (or a whole namespace) from every node", _evict_job),
    ]
    for name, help_text, job in commands:
        sub = subs.add_parser(name, help=help_text, description=help_text, out=out, err=err)
        _connection_options(sub, None)
        sub.add_argument("--json", action="store_true", help="print JSON instead of a table")
        sub.set_defaults(prepare=job)
        if name == "lookup":
            _lookup_options(sub)
        elif name == "evict":
            _lookup_options(sub, tokens_required=False)
            sub.add_argument(
                "--tenant",
                default="",
                help="the tenant whose namespace it is (auth files name tenants; "
                "default: the untenanted namespace)",
            )
        elif name == "drain":
            sub.add_argument("node", metavar="NODE", help="node id")
            sub.add_argument("--undrain", action="store_true", help="clear the draining mark")
            sub.add_argument(
                "--wait",
                action="store_true",
                help="then wait until the node has copied every block to other nodes "
                "(it may then leave with nothing lost)",
            )
            sub.add_argument(
                "--wait-s",
                type=_seconds,
                default=600.0,
                metavar="S",
                help="with --wait: give up after this long, exit 1 (default 600)",
            )
    _top_parser(subs, out, err)
    return parser


def _top_parser(subs: Any, out: TextIO, err: TextIO) -> None:
    help_text = "a live view of the pool: nodes, tiers, hit ratio, transfer rates, evictions"
    sub = subs.add_parser("top", help=help_text, description=help_text, out=out, err=err)
    _connection_options(sub, None)
    sub.add_argument("--once", action="store_true", help="print one snapshot and exit")
    sub.add_argument(
        "--interval",
        type=_seconds,
        default=1.0,
        metavar="S",
        help="seconds between refreshes; --once takes its two snapshots this far apart, "
        "for the rates (default 1)",
    )
    sub.add_argument(
        "--metrics",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a kvstore process's Prometheus endpoint, for transfer rates, evictions and "
        "stale misses (repeatable)",
    )
    sub.add_argument(
        "--node-metrics-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="also read every live node's /metrics at its data host and this port "
        "(kvstore node's default is 9401)",
    )
    sub.add_argument("--json", action="store_true", help="with --once: print JSON")

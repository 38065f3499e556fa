"""Configuration of ``kvstore serve | master | node``: one table of settings, four sources.

Every setting is one :class:`Setting` in :data:`SETTINGS` and has, derived from its name,
a flag, an environment variable and a key in a TOML file::

    flag            environment              file key       (default)
    --host-mem      KVSTORE_HOST_MEM         host-mem       512MiB
    --log-level     KVSTORE_LOG_LEVEL        log-level      WARNING   (also $KVSTORE_LOG)
    --master        KVSTORE_MASTER           master         (node: required)

Precedence, per setting: **flag > environment > file > default**. The file is named by
``--config PATH`` (or ``$KVSTORE_CONFIG``) and read with :mod:`tomllib`; its top-level keys
apply to every command that has the setting (``host-mem`` to serve and node, not to
master), and a ``[serve]``, ``[master]`` or ``[node]`` table applies to that command only
(over the top level), so one file can configure every process of a pool. At the top
level, ``master = "HOST:PORT"`` (a string) is the node's ``--master`` and ``[master]`` (a
table) the master command's settings; TOML allows only one of them in a file, so a file
for every command names the node's master under ``[node]``::

    log-level = "INFO"
    host = "0.0.0.0"
    [master]
    redis = "redis://redis:6379/0"
    [node]
    master = "kvstore-master:50051"
    host-mem = "4GiB"

Everything is validated here, before the servers (and torch) are imported: a bad size, a
port outside 0..65535, an unknown log level, ``--master`` without a port, a key in the
file that is no setting (of that table's command), or ``--gpu-mem`` without
``--transport ucx`` raise :class:`~kvstore.errors.InvalidArgument` naming where the value
came from; the CLI prints it as one line and exits 2. Environment variables with the
``KVSTORE_`` prefix that name no setting (``KVSTORE_TOKEN``, ``KVSTORE_TEST_REDIS``) are
left alone: other tools share the prefix. An empty variable counts as unset (a Kubernetes
``env`` entry with an empty value, an unset compose interpolation).

:func:`resolve` returns a :class:`Resolved` (each value and where it came from);
:func:`render_toml` prints it as a TOML file that ``--config`` reads back unchanged
(``kvstore config``). This module imports the standard library, ``kvstore.errors`` and
``kvstore.core.sizes`` only.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.core.sizes import format_size, parse_size
from kvstore.errors import InvalidArgument

__all__ = [
    "COMMANDS",
    "CONFIG_ENV",
    "LOG_LEVELS",
    "PORT_SETTINGS",
    "SETTINGS",
    "Resolved",
    "Setting",
    "format_size",
    "parse_size",
    "render_toml",
    "resolve",
    "settings_for",
]

COMMANDS = ("serve", "master", "node")
"""The server commands that take settings (``kvstore config`` shows any of them)."""

CONFIG_ENV = "KVSTORE_CONFIG"
"""The environment variable naming the config file when ``--config`` is not given."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

Value = str | int | float | bool | None

# -- values: each parser takes flag/environment text or a TOML value ------------------------


def _integer(value: object) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(f"not an integer: {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise InvalidArgument(f"not an integer: {value!r}")


def _port(value: object) -> int:
    try:
        port = _integer(value)
    except InvalidArgument:
        raise InvalidArgument(f"not a port: {value!r}") from None
    if not 0 <= port <= 65535:
        raise InvalidArgument(f"port {port} outside 0..65535")
    return port


def _port_or_off(value: object) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "off":
        return "off"
    return _port(value)


def _count(value: object) -> int:
    n = _integer(value)
    if n < 1:
        raise InvalidArgument(f"must be >= 1, got {n}")
    return n


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise InvalidArgument(f"not a number of seconds: {value!r}")
    try:
        seconds = float(value)
    except ValueError:
        raise InvalidArgument(f"not a number of seconds: {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise InvalidArgument(f"must be > 0 seconds, got {value!r}")
    return seconds


def _seconds_or_off(value: object) -> float:
    if value in (0, "0", 0.0):
        return 0.0
    return _seconds(value)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _switch(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise InvalidArgument(f"not true or false: {value!r}")


def _path(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"not a path: {value!r}")
    return value.strip()


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"not a string: {value!r}")
    return value.strip()


def _host(value: object) -> str:
    host = _text(value)
    if not host:
        raise InvalidArgument("the host must not be empty")
    return host


def _log_level(value: object) -> str:
    level = _text(value).upper()
    if level not in LOG_LEVELS:
        raise InvalidArgument(f"unknown log level {value!r}: one of {', '.join(LOG_LEVELS)}")
    return level


def _transport(value: object) -> str:
    transport = _text(value).lower()
    if transport not in ("tcp", "ucx"):
        raise InvalidArgument(f"unknown transport {value!r}: tcp or ucx")
    return transport


def _disk_compress(value: object) -> str:
    mode = _text(value).lower()
    if mode not in ("auto", "lz4", "off"):
        raise InvalidArgument(f"unknown disk compression {value!r}: auto, lz4 or off")
    return mode


def _master_address(value: object) -> str:
    """``HOST:PORT`` (``[v6]:PORT``) of a master, port 1..65535, or several of them
    separated by commas (masters sharing one Redis: the node fails over between them)."""
    text = _text(value)
    parts = [p.strip() for p in text.split(",")]
    for part in parts:
        host, sep, port = part.rpartition(":")
        bad_host = not host or host in ("[", "[]") or (":" in host and not host.startswith("["))
        if not sep or bad_host:
            raise InvalidArgument(f"{part!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
        if _port(port) == 0:
            raise InvalidArgument(f"{part!r}: the master's port must not be 0")
    return ",".join(parts)


def _redis_url(value: object) -> str:
    url = _text(value)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise InvalidArgument(f"{url!r} is not a redis://, rediss:// or unix:// URL")
    return url


def _node_id(value: object) -> str:
    node_id = _text(value)
    if len(node_id) > 128 or any(c.isspace() for c in node_id):
        raise InvalidArgument(f"{node_id!r}: a node id has no spaces and at most 128 chars")
    return node_id


def _render_plain(value: Value) -> str:
    return str(value)


def _render_size(value: Value) -> str:
    return format_size(value) if isinstance(value, int) else str(value)


# -- the table ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One setting of one or more commands: ``--NAME``, ``KVSTORE_NAME``, file key NAME."""

    name: str
    """The flag without its dashes, also the key in a config file: ``"host-mem"``."""
    parse: Callable[[object], Value]
    """Flag/environment text or a TOML value -> the value; raises InvalidArgument."""
    default: Value | Mapping[str, Value]
    """The default, or one per command (``metrics-port``); None: unset."""
    help: str
    commands: tuple[str, ...]
    metavar: str = ""
    render: Callable[[Value], str] = _render_plain
    """How a value is shown in help and written to a file (sizes: ``512MiB``)."""
    aliases: tuple[str, ...] = ()
    """Older environment variables read when the canonical one is unset."""
    required: tuple[str, ...] = ()
    """Commands that refuse to start without this setting."""
    switch: bool = False
    """A flag that takes no value (``--insecure``); true or false in a file or variable."""

    @property
    def flag(self) -> str:
        """``--host-mem``."""
        return f"--{self.name}"

    @property
    def dest(self) -> str:
        """``host_mem``: the attribute name (argparse, :class:`Resolved`)."""
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        """``KVSTORE_HOST_MEM``."""
        return "KVSTORE_" + self.dest.upper()

    def default_for(self, command: str) -> Value:
        """The default under ``command``."""
        if isinstance(self.default, Mapping):
            return self.default[command]
        return self.default

    def shown(self, value: Value) -> str:
        """``value`` as help text and ``kvstore config`` show it."""
        if value is None:
            return "unset"
        return '""' if value == "" else self.render(value)


_BOTH = ("serve", "master", "node")
_MASTERS = ("serve", "master")
_NODES = ("serve", "node")

SETTINGS: tuple[Setting, ...] = (
    Setting("log-level", _log_level, "WARNING", "log level on stderr: "
            + " | ".join(LOG_LEVELS), _BOTH, "LEVEL", aliases=("KVSTORE_LOG",)),
    Setting("host", _host, "127.0.0.1", "address to bind every port on", _BOTH, "ADDR"),
    Setting("metrics-port", _port, {"serve": 9400, "master": 9400, "node": 9401},
            "Prometheus /metrics port (0: a free one)", _BOTH, "PORT"),
    Setting("grpc-port", _port, 50051, "the master's gRPC port (0: a free one)", _MASTERS,
            "PORT"),
    Setting("commit-port", _port_or_off, 0, "the master's commit port: its nodes send "
            "their commits there, framed as data exchanges, and over gRPC only while it is "
            "out of reach (0: a free one, told to each node; off: none)", ("master",),
            "PORT"),
    Setting("node-lease-s", _seconds, 10.0, "a node silent for half this long is suspect, "
            "for this long dead; heartbeats every third of it", _MASTERS, "S"),
    Setting("redis", _redis_url, None, "keep the index, membership and watches in Redis "
            "(redis://host:port/db) so several masters share one pool; unset: in this "
            "process", ("master",), "URL"),
    Setting("master", _master_address, None, "HOST:PORT of the master this node registers "
            "with; several, comma-separated, for masters sharing one Redis (it fails over)",
            ("node",), "HOST:PORT[,HOST:PORT]", required=("node",)),
    Setting("data-port", _port, 50052, "the node's tcp:// data port (0: a free one)", _NODES,
            "PORT"),
    Setting("node-id", _node_id, "", "this node's id (empty: node-<random>); a node that "
            "restarts with its id keeps its place in placement", _NODES, "ID"),
    Setting("host-mem", parse_size, 512 << 20, "host-memory tier of this node "
            "(4096, 512MiB, 4GiB, 1G, 100MB)", _NODES, "SIZE", render=_render_size),
    Setting("prefault-memory", _switch, True, "map the host-memory tier's pages when the "
            "node starts (on a thread of its own), so puts do not pay a page fault per page "
            "they first write (ucx: once its NIXL agent registered it)", _NODES, "true|false",
            render=lambda v: "true" if v else "false"),
    Setting("huge-pages", _switch, True, "back the host-memory tier with transparent huge "
            "pages where the kernel has them (a ucx:// WRITE or READ on one host takes about "
            "0.6x / 0.55x the time; false: 4 KiB pages); the node's stats say "
            "host_huge_bytes once its start-up mapping ended", _NODES, "true|false",
            render=lambda v: "true" if v else "false"),
    Setting("gpu-mem", parse_size, 0, "a GPU tier of this size on the current CUDA device, "
            "where ucx:// puts land (0: none; needs --transport ucx)", _NODES, "SIZE",
            render=_render_size),
    Setting("disk-path", _path, None, "a directory for a disk tier below host memory: "
            "blocks are written there behind the puts, read back verified, and kept across "
            "restarts (unset: none; needs --disk-size)", _NODES, "DIR"),
    Setting("disk-size", parse_size, 0, "bytes the disk tier's segments may take",
            _NODES, "SIZE", render=_render_size),
    Setting("disk-compress", _disk_compress, "auto", "lz4 on the disk tier: auto packs "
            "blocks where this disk's and lz4's measured speeds say reads get faster (raw "
            "16-bit KV on a slow disk), lz4 always, off never", _NODES, "auto|lz4|off"),
    Setting("transport", _transport, "tcp", "tcp: the tcp:// data port only; ucx: also "
            "one-sided NIXL/UCX reads and writes (needs nixl-cu12)", _NODES, "tcp|ucx"),
    Setting("io-timeout-s", _seconds, 30.0, "deadline of each step of a data-plane "
            "exchange; also how long a stalled writer can hold a chunk others wait for",
            _NODES, "S"),
    Setting("max-connections", _count, 1024, "data-port connections served at once; more "
            "are refused with a capacity error (lowered to fit the file descriptor limit)",
            _NODES, "N"),
    Setting("idle-timeout-s", _seconds, 60.0, "close a data connection that carried no "
            "request for this long", _NODES, "S"),
    Setting("header-timeout-s", _seconds, 5.0, "a frame header must arrive whole within "
            "this long of its first byte", _NODES, "S"),
    Setting("auth-file", _path, None, "TOML file of the cluster secret and the tokens "
            "(chmod 600): every master call then needs a token whose role may make it",
            _BOTH, "PATH"),
    Setting("tls-cert", _path, None, "PEM certificate: a master serves gRPC over TLS "
            "only; a node presents it to its master (client certificate)", _BOTH, "PATH"),
    Setting("tls-key", _path, None, "the private key of --tls-cert (chmod 600)", _BOTH,
            "PATH"),
    Setting("tls-client-ca", _path, None, "a master with TLS requires every caller to "
            "present a certificate this CA signed (mutual TLS)", _MASTERS, "PATH"),
    Setting("tls-ca", _path, None, "a node speaks TLS to its master and verifies the "
            "master's certificate against this CA", ("node",), "PATH"),
    Setting("data-tls", _switch, False, "serve the data port as tls:// (TLS 1.3) with "
            "--tls-cert and --tls-key; clients verify it with their CA file", _NODES, "",
            render=lambda v: "true" if v else "false", switch=True),
    Setting("insecure", _switch, False, "serve a non-loopback address without an "
            "auth file (anyone who reaches the port may read, write and evict KV)", _BOTH,
            "", render=lambda v: "true" if v else "false", switch=True),
    Setting("drain-on-exit", _seconds_or_off, 0.0, "on SIGTERM, first mark this node "
            "draining and copy its blocks to other nodes for at most this long, then leave "
            "(0: leave at once; either way it deregisters)", ("node",), "S"),
)  # fmt: skip
"""Every setting of every server command, in the order help and ``kvstore config`` show."""


_NAMES = frozenset(s.name for s in SETTINGS)


def settings_for(command: str) -> tuple[Setting, ...]:
    """The settings ``command`` takes, in :data:`SETTINGS` order."""
    if command not in COMMANDS:
        raise InvalidArgument(f"unknown command {command!r}: one of {', '.join(COMMANDS)}")
    return tuple(s for s in SETTINGS if command in s.commands)


# -- resolution ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    """The effective configuration of one command: each value and where it came from."""

    command: str
    values: Mapping[str, Value]
    """By :attr:`Setting.dest`."""
    sources: Mapping[str, str]
    """By dest: ``"flag --host-mem"``, ``"env KVSTORE_HOST_MEM"``, ``"file PATH"`` or
    ``"default"``."""
    config_file: str | None = None
    config_source: str = ""
    """Where the file's name came from (``flag --config``, ``env KVSTORE_CONFIG``)."""

    def __getitem__(self, dest: str) -> Any:
        """The value of the setting named ``dest`` (``"host_mem"``)."""
        return self.values[dest]


def resolve(
    command: str,
    flags: Mapping[str, Value],
    environ: Mapping[str, str],
    config_file: str | None = None,
) -> Resolved:
    """The effective configuration of ``command``.

    ``flags``: values given on the command line (already parsed), by dest; ``environ``: the
    process environment; ``config_file``: ``--config`` (else ``$KVSTORE_CONFIG`` is used).
    Reads the file (blocking, small). Raises InvalidArgument naming the flag, variable or
    file and key of the first bad value.
    """
    settings = settings_for(command)
    config_source = "flag --config" if config_file else ""
    if not config_file and environ.get(CONFIG_ENV):
        config_file, config_source = environ[CONFIG_ENV], f"env {CONFIG_ENV}"
    from_file = _read_file(config_file, command) if config_file else {}
    values: dict[str, Value] = {}
    sources: dict[str, str] = {}
    for s in settings:
        values[s.dest], sources[s.dest] = _pick(s, command, flags, environ, from_file, config_file)
    _check_together(values, sources)
    return Resolved(command, values, sources, config_file, config_source)


def _pick(
    s: Setting,
    command: str,
    flags: Mapping[str, Value],
    environ: Mapping[str, str],
    from_file: Mapping[str, object],
    config_file: str | None,
) -> tuple[Value, str]:
    if s.dest in flags:
        return flags[s.dest], f"flag {s.flag}"
    for var in (s.env, *s.aliases):
        if environ.get(var, "") != "":
            return _parsed(s, environ[var], var), f"env {var}"
    if s.name in from_file:
        return _parsed(s, from_file[s.name], f"{config_file}: {s.name}"), f"file {config_file}"
    if command in s.required:
        raise InvalidArgument(f"{s.flag} is required (or {s.env}, or {s.name} in a --config file)")
    return s.default_for(command), "default"


def _parsed(s: Setting, raw: object, where: str) -> Value:
    try:
        return s.parse(raw)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc}") from None


MIN_DISK_BYTES = 8 * 1024
"""The least ``--disk-size`` (two of the disk tier's 4 KiB-aligned records,
``kvstore.node.disk``)."""

PORT_SETTINGS: dict[str, str] = {"grpc_port": "gRPC", "commit_port": "commit",
                                 "data_port": "data", "metrics_port": "metrics"}  # fmt: skip
"""The settings that name a port a server of the command binds (dest → that server)."""


def _check_together(values: Mapping[str, Value], sources: Mapping[str, str]) -> None:
    """Checks across settings (decisions: "--gpu-mem without --transport ucx is refused")."""
    if values.get("disk_path") and not values.get("disk_size"):
        raise InvalidArgument(
            f"--disk-path (from {sources['disk_path']}) needs --disk-size: the bytes the "
            "disk tier may take"
        )
    disk_size = values.get("disk_size")
    if isinstance(disk_size, int) and disk_size and not values.get("disk_path"):
        raise InvalidArgument(
            f"--disk-size (from {sources['disk_size']}) needs --disk-path: the directory "
            "of the disk tier"
        )
    if isinstance(disk_size, int) and 0 < disk_size < MIN_DISK_BYTES:
        raise InvalidArgument(
            f"--disk-size {format_size(disk_size)} (from {sources['disk_size']}): the disk "
            f"tier needs {format_size(MIN_DISK_BYTES)} at least"
        )
    gpu_mem = values.get("gpu_mem")
    if isinstance(gpu_mem, int) and gpu_mem > 0 and values.get("transport") != "ucx":
        raise InvalidArgument(
            f"--gpu-mem {format_size(gpu_mem)} (from {sources['gpu_mem']}) needs --transport "
            "ucx: only ucx:// puts land in the GPU tier, so without it the tier would never "
            "be written"
        )
    fixed: dict[int, str] = {}  # two servers of one process never share a fixed port
    for dest in PORT_SETTINGS:
        port = values.get(dest)
        if not isinstance(port, int) or isinstance(port, bool) or port == 0:
            continue
        if port in fixed:
            first = fixed[port]
            raise InvalidArgument(
                f"--{dest.replace('_', '-')} {port} (from {sources[dest]}) is also "
                f"--{first.replace('_', '-')} (from {sources[first]}): each server needs a "
                "port of its own"
            )
        fixed[port] = dest


def _read_file(path: str, command: str) -> dict[str, object]:
    """The keys of ``path`` that apply to ``command``: its table over the top level.

    A top-level key must be a setting of some command and applies to the commands that
    have it (``host-mem`` to serve and node, not to master); a key in a ``[serve]``,
    ``[master]`` or ``[node]`` table must be a setting of that command."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise InvalidArgument(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{path}: not valid TOML: {exc}") from None
    tables: dict[str, dict[str, object]] = {}
    top: dict[str, object] = {}
    for key, value in doc.items():
        if key in COMMANDS and isinstance(value, dict):
            for name in value:
                _known_key(f"{path}: [{key}] {name}", name, key)
            tables[key] = value
        elif key in COMMANDS and key not in _NAMES:
            raise InvalidArgument(f"{path}: {key} must be a table ([{key}])")
        else:  # (``master = "HOST:PORT"`` is the node's setting, ``[master]`` the table)
            _known_key(f"{path}: {key}", key, None)
            top[key] = value
    own = {s.name for s in settings_for(command)}
    return {**{k: v for k, v in top.items() if k in own}, **tables.get(command, {})}


def _known_key(where: str, key: str, command: str | None) -> None:
    """Raise InvalidArgument unless ``key`` is a setting of ``command`` (None: of any)."""
    names = [s.name for s in (SETTINGS if command is None else settings_for(command))]
    if key in names:
        return
    whose = "any command" if command is None else f"`kvstore {command}`"
    owners = [", ".join(s.commands) for s in SETTINGS if s.name == key]
    close = difflib.get_close_matches(key.replace("_", "-"), names, n=1)
    if owners:
        hint = f"only of {owners[0]}"
    elif close:
        hint = f"did you mean {close[0]}?"
    else:
        hint = f"known: {', '.join(names)}"
    raise InvalidArgument(f"{where}: not a setting of {whose} ({hint})")


# -- rendering -----------------------------------------------------------------------------


def _toml_value(s: Setting, value: Value) -> str:
    if s.render is _render_size:
        return json.dumps(s.render(value)) if value else "0"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON strings are TOML basic strings
    return repr(value)


def render_toml(resolved: Resolved) -> str:
    """``resolved`` as a TOML file (``--config`` reads it back to the same values), each
    line commented with where its value came from."""
    command = resolved.command
    lines = [
        f"# kvstore {command}: effective configuration "
        "(flag > environment KVSTORE_* > file > default)"
    ]
    if resolved.config_file:
        lines.append(f"# config file: {resolved.config_file} ({resolved.config_source})")
    rows = []
    for s in settings_for(command):
        value, source = resolved.values[s.dest], resolved.sources[s.dest]
        if value is None:
            rows.append((f"# {s.name} = ", f"unset ({source})"))
        else:
            rows.append((f"{s.name} = {_toml_value(s, value)}", source))
    width = max(len(left) for left, _ in rows)
    lines += [f"{left.ljust(width)}  # {source}" for left, source in rows]
    return "\n".join(lines) + "\n"

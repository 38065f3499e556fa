"""Configuration of ``kvstore serve | master | node``: flags > ``KVSTORE_*`` environment >
``--config`` TOML file > defaults, ``kvstore config``, and bad values rejected with one line
and exit 2 before torch is imported. Each case runs the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

from kvstore.config import SETTINGS, format_size, parse_size, settings_for
from kvstore.core.arena import parse_size as arena_parse_size
from kvstore.errors import InvalidArgument
from tests.cluster import start_server

ROOT = Path(__file__).resolve().parent.parent
DEPLOY_TOML = ROOT / "deploy" / "kvstore.toml"

# Runs the CLI with torch and grpc made unimportable: a value rejected before the servers
# are imported exits 2 with its one line; anything that reaches for them would traceback.
_LIGHT = """
import sys
sys.modules["torch"] = None
sys.modules["grpc"] = None
from kvstore.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any KVSTORE_* setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return {**env, **(extra or {})}


def _cli(
    *args: str, env: Mapping[str, str] | None = None, light: bool = False
) -> subprocess.CompletedProcess[str]:
    head = ["-c", _LIGHT] if light else ["-m", "kvstore.cli"]
    return subprocess.run(
        [sys.executable, *head, *args],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        env=_clean_env(env), cwd=ROOT,
    )  # fmt: skip


def _effective(
    *args: str, env: Mapping[str, str] | None = None
) -> tuple[dict[str, object], dict[str, str]]:
    """``kvstore config ARGS``: (the values as TOML reads them, the source of each key)."""
    out = _cli("config", *args, env=env, light=True)
    assert out.returncode == 0, out.stderr
    sources = dict(re.findall(r"^#? ?([\w-]+) = .*?  # (.+)$", out.stdout, re.M))
    return tomllib.loads(out.stdout), sources


# -- values ------------------------------------------------------------------------------


SIZES = {"4096": 4096, "512MiB": 512 << 20, "4GiB": 4 << 30, "1G": 1 << 30, "100MB": 10**8,
         "1.5GiB": 3 << 29, " 2 kib ": 2048, "0": 0, "1.5": "error", "lots": "error",
         "": "error", "-1": "error", "1.0000001KiB": "error", "3TB": 3 * 10**12, "7b": 7,
         "1e3": "error", ".5M": 512 << 10}  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), SIZES.items())
def test_size_grammar(text: str, expected: int | str) -> None:
    """The one torch-free size parser (``kvstore.core.sizes``), which the arena uses too."""
    try:
        got: int | str = parse_size(text)
    except InvalidArgument:
        got = "error"
    assert got == expected
    assert arena_parse_size is parse_size  # (one parser: the flags mean what the arena means)


def test_format_size_round_trips() -> None:
    for n in (0, 1, 4096, 512 << 20, 4 << 30, 3 << 40, 1000, (1 << 30) + 1):
        assert parse_size(format_size(n)) == n


def test_every_setting_has_help_and_a_variable() -> None:
    for s in SETTINGS:
        assert s.help and s.env == "KVSTORE_" + s.name.upper().replace("-", "_")


# -- bad values: one line, exit 2, no torch ----------------------------------------------


BAD = [
    (("serve", "--host-mem", "lots"), {}, "--host-mem"),
    (("serve", "--log-level", "LOUD"), {}, "LOUD"),
    (("node", "--master", "127.0.0.1"), {}, "HOST:PORT"),
    (("node", "--master", "127.0.0.1:0"), {}, "port"),
    (("node",), {}, "--master is required"),
    (("serve", "--grpc-port", "70000"), {}, "70000"),
    (("serve", "--data-port", "-1"), {}, "-1"),
    (("serve", "--transport", "rdma"), {}, "rdma"),
    (("serve", "--disk-compress", "zstd"), {}, "zstd"),
    (("serve", "--io-timeout-s", "0"), {}, "io-timeout-s"),
    (("serve", "--max-connections", "0"), {}, "max-connections"),
    (("serve", "--gpu-mem", "1GiB"), {}, "--transport ucx"),
    (("serve", "--disk-size", "64MiB"), {}, "--disk-size) needs --disk-path"),
    (("serve", "--disk-path", "/tmp/d", "--disk-size", "1"), {}, "needs 8KiB at least"),
    (("master", "--grpc-port", "50070", "--commit-port", "50070"), {}, "--grpc-port (from flag"),
    (("serve", "--data-port", "50071"), {"KVSTORE_METRICS_PORT": "50071"}, "KVSTORE_METRICS_PORT"),
    (("serve",), {"KVSTORE_GPU_MEM": "1GiB"}, "KVSTORE_GPU_MEM"),
    (("serve",), {"KVSTORE_HOST_MEM": "lots"}, "KVSTORE_HOST_MEM"),
    (("serve",), {"KVSTORE_LOG": "LOUD"}, "KVSTORE_LOG"),
    (("serve",), {"KVSTORE_METRICS_PORT": "65536"}, "KVSTORE_METRICS_PORT"),
    (("node",), {"KVSTORE_MASTER": "localhost"}, "KVSTORE_MASTER"),
    (("master", "--redis", "localhost:6379"), {}, "redis://"),
    (("serve", "--bogus"), {}, "--bogus"),
    (("serve", "--config", "/nonexistent/kvstore.toml"), {}, "cannot read config file"),
    (("config", "serve", "--host-mem", "lots"), {}, "--host-mem"),
]


@pytest.mark.parametrize(("args", "env", "needle"), BAD)
def test_bad_value_is_one_line_and_exit_2_before_torch(
    args: tuple[str, ...], env: dict[str, str], needle: str
) -> None:
    out = _cli(*args, env=env, light=True)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert lines[0].startswith("kvstore"), out.stderr
    assert out.stdout == ""


BAD_FILES = [
    ('host_mem = "1GiB"\n', "did you mean host-mem?"),
    ("colour = 1\n", "not a setting of any command"),
    ("[serve]\nredis = 'redis://r:6379/0'\n", "only of master"),
    ('host-mem = "lots"\n', "host-mem: not a size"),
    ("grpc-port = 70000\n", "grpc-port: port 70000 outside"),
    ('grpc-port = "x"\n', "not a port"),
    ("node-lease-s = true\n", "node-lease-s"),
    ("log-level = 'LOUD'\n", "unknown log level"),
    ("serve = 3\n", "must be a table"),
    ("host = \n", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "needle"), BAD_FILES)
def test_bad_config_file_is_one_line_and_exit_2(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(text)
    out = _cli("serve", "--config", str(path), light=True)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert needle in lines[0] and str(path) in lines[0], out.stderr


def test_help_shows_every_flag_with_its_default_and_variable() -> None:
    for command in ("serve", "master", "node"):
        out = _cli(command, "--help", light=True)
        assert out.returncode == 0, out.stderr
        text = " ".join(out.stdout.split())  # argparse wraps help lines
        for s in settings_for(command):
            value = "" if s.switch else r"\S+ "  # (a switch takes no value)
            assert re.search(rf"{s.flag} {value}.*?\(default: [^;]+; env {s.env}", text), s.flag


# -- precedence and `kvstore config` -----------------------------------------------------


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text('host-mem = "1GiB"\ndata-port = 7001\ngrpc-port = 7002\n'
                    '[serve]\ngrpc-port = 7003\n')  # fmt: skip
    env = {"KVSTORE_CONFIG": str(path), "KVSTORE_DATA_PORT": "7004", "KVSTORE_HOST_MEM": "2GiB"}
    values, sources = _effective("serve", "--host-mem", "3GiB", env=env)
    assert values["host-mem"] == "3GiB" and sources["host-mem"] == "flag --host-mem"
    assert values["data-port"] == 7004 and sources["data-port"] == "env KVSTORE_DATA_PORT"
    assert values["grpc-port"] == 7003 and sources["grpc-port"] == f"file {path}"
    assert values["idle-timeout-s"] == 60.0 and sources["idle-timeout-s"] == "default"
    # The top level applies to each command that has the setting; master has no host-mem.
    values, _ = _effective("master", env={"KVSTORE_CONFIG": str(path)})
    assert values["grpc-port"] == 7002 and "host-mem" not in values


def test_log_level_variable_and_its_old_name() -> None:
    values, sources = _effective("serve", env={"KVSTORE_LOG": "debug"})
    assert values["log-level"] == "DEBUG" and sources["log-level"] == "env KVSTORE_LOG"
    values, sources = _effective("serve", env={"KVSTORE_LOG": "debug", "KVSTORE_LOG_LEVEL": "info"})
    assert values["log-level"] == "INFO" and sources["log-level"] == "env KVSTORE_LOG_LEVEL"
    values, sources = _effective("serve", "--log-level", "error", env={"KVSTORE_LOG": "debug"})
    assert values["log-level"] == "ERROR"


def test_node_master_from_kvstore_master() -> None:
    values, sources = _effective("node", env={"KVSTORE_MASTER": "10.0.0.1:50051"})
    assert values["master"] == "10.0.0.1:50051" and sources["master"] == "env KVSTORE_MASTER"


def test_effective_configuration_reads_back_unchanged(tmp_path: Path) -> None:
    """``kvstore config`` prints a file that ``--config`` turns into the same values."""
    first = _cli("config", "node", "--master", "[::1]:50051", "--host-mem", "1.5GiB",
                 "--node-id", "n-1", "--io-timeout-s", "2.5", light=True)  # fmt: skip
    assert first.returncode == 0, first.stderr
    path = tmp_path / "effective.toml"
    path.write_text(first.stdout)
    again, sources = _effective("node", "--config", str(path))
    assert again == tomllib.loads(first.stdout)
    unset = {k for k, src in sources.items() if src.startswith("unset")}  # (commented out)
    assert unset == {"auth-file", "tls-cert", "tls-key", "tls-ca", "disk-path"}  # (paths)
    assert {src for k, src in sources.items() if k not in unset} == {f"file {path}"}


def _file_as_env(path: Path, command: str) -> dict[str, str]:
    """The settings ``path`` gives ``command``, as KVSTORE_* variables."""
    doc = tomllib.loads(path.read_text())
    own = {s.name: s for s in settings_for(command)}
    keys = {k: v for k, v in doc.items() if k in own} | doc.get(command, {})
    return {own[k].env: v if isinstance(v, str) else json.dumps(v) for k, v in keys.items()}


def test_deploy_file_and_the_same_environment_are_the_same_configuration() -> None:
    by_file, _ = _effective("serve", "--config", str(DEPLOY_TOML))
    env = _file_as_env(DEPLOY_TOML, "serve")
    assert len(env) >= 10
    by_env, sources = _effective("serve", env=env)
    assert by_env == by_file
    assert all(
        src.startswith("env KVSTORE_")
        for k, src in sources.items()
        # (unset in the file: no secrets in it, no certificates, no disk tier)
        if k
        not in (
            "node-id",
            "auth-file",
            "tls-cert",
            "tls-key",
            "tls-client-ca",
            "disk-path",
            "disk-size",
        )
    )


@pytest.mark.slow
def test_serve_from_the_deploy_file_and_from_the_environment_start_the_same_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real ``kvstore serve --config deploy/kvstore.toml`` and one configured by the same
    settings as KVSTORE_* variables serve the same pool. Ports are taken free by flags (they
    beat the file and the environment) and host-mem is shrunk by the environment (it beats
    the file) so the test fits a shared machine."""
    free = ("--grpc-port", "0", "--data-port", "0", "--metrics-port", "0")
    small = {"KVSTORE_HOST_MEM": "64MiB"}
    kvctl = str(Path(sys.executable).parent / "kvctl")
    pools = []
    for env, config in ((small, ("--config", str(DEPLOY_TOML))),
                        (_file_as_env(DEPLOY_TOML, "serve") | small, ())):  # fmt: skip
        with monkeypatch.context() as m:
            for name in [k for k in os.environ if k.startswith("KVSTORE_")]:
                m.delenv(name)
            for name, value in env.items():
                m.setenv(name, value)
            server = start_server("serve", *config, *free)  # (inherits os.environ)
        try:
            status = subprocess.run(
                [kvctl, "--master", server.grpc, "nodes", "--json"],
                capture_output=True, text=True, timeout=60, env=_clean_env(),
            )  # fmt: skip
            assert status.returncode == 0, status.stderr
            [node] = json.loads(status.stdout)["nodes"]
            pools.append((node["alive"], node["data"].split(":")[1], node["tiers"]))
        finally:
            rc, out = server.stop()
        assert rc == 0 and "pinned_slots=0" in out, out
    assert pools[0] == pools[1]
    assert pools[0][0] is True and pools[0][1] == "//127.0.0.1"
    assert [t["capacity_bytes"] for t in pools[0][2]] == [64 << 20]


def test_one_file_for_every_command(tmp_path: Path) -> None:
    """Top-level keys apply to the commands that have them, tables to their command; at the
    top level ``master = "HOST:PORT"`` is the node's setting, ``[master]`` the table."""
    path = tmp_path / "pool.toml"
    path.write_text('host-mem = "1GiB"\n[master]\ngrpc-port = 7005\n'
                    '[node]\nhost-mem = "2GiB"\nmaster = "m:50051"\n')  # fmt: skip
    node, _ = _effective("node", "--config", str(path))
    assert node["master"] == "m:50051" and node["host-mem"] == "2GiB"
    master, _ = _effective("master", "--config", str(path))
    assert master["grpc-port"] == 7005 and "master" not in master
    serve, _ = _effective("serve", "--config", str(path))
    assert serve["host-mem"] == "1GiB" and serve["grpc-port"] == 50051
    path.write_text('master = "m:50052"\n')
    node, _ = _effective("node", "--config", str(path))
    assert node["master"] == "m:50052"


def test_an_empty_variable_counts_as_unset() -> None:
    values, sources = _effective("serve", env={"KVSTORE_HOST_MEM": "", "KVSTORE_CONFIG": ""})
    assert values["host-mem"] == "512MiB" and sources["host-mem"] == "default"

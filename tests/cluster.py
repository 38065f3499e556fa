"""Real processes for integration tests: ``kvstore serve`` / ``master`` / ``node`` as
subprocesses on loopback with port 0, waited for on their ``kvstore ready`` line."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvclient.ucx import nixl_available
from kvstore.dataplane import NodeClient

__all__ = [
    "TRANSPORTS",
    "Server",
    "node_stats",
    "rpc_count",
    "run_kvctl",
    "serving",
    "start_server",
    "start_servers",
]

TRANSPORTS = [
    "tcp",
    pytest.param(
        "ucx", marks=pytest.mark.skipif(not nixl_available(), reason="nixl-cu12 not installed")
    ),
]
"""The real data-plane transports, for ``@pytest.fixture(params=TRANSPORTS)``."""


@dataclass
class Server:
    """A running ``kvstore`` process and the addresses its ready line announced."""

    proc: subprocess.Popen[str]
    addresses: dict[str, str]
    lines: list[str] = field(default_factory=list)

    @property
    def grpc(self) -> str:
        """``host:port`` of the master (serve, master)."""
        return self.addresses["grpc"]

    @property
    def data(self) -> str:
        """``tcp://host:port`` of the node (serve, node)."""
        return self.addresses["data"]

    def stop(self, timeout: float = 20.0) -> tuple[int, str]:
        """SIGTERM, wait, and return (exit status, everything printed on stdout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=5)
        return self.proc.returncode, "".join(self.lines) + (out or "")

    def kill(self) -> None:
        """``kill -9`` and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)


KVCTL = str(Path(sys.executable).with_name("kvctl"))


def run_kvctl(
    master: Server, *argv: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """``kvctl --master MASTER ARGV`` with no ``KVSTORE_*`` variable of this process
    (only those in ``env``), its output captured."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    return subprocess.run(
        [KVCTL, "--master", master.grpc, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean | (env or {}),
        check=False,
    )


def start_server(*args: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> Server:
    """Start ``python -m kvstore.cli ARGS`` (``env``: more environment variables) and wait
    for its ready line (or fail)."""
    return _ready(_spawn(args, env), args, timeout)


def start_servers(*argvs: tuple[str, ...] | list[str], timeout: float = 60.0) -> list[Server]:
    """Start several servers at once (their imports overlap), then wait for each ready
    line in turn; on a failure the ones started are stopped."""
    procs = [_spawn(tuple(argv)) for argv in argvs]
    servers: list[Server] = []
    try:
        for proc, argv in zip(procs, argvs, strict=True):
            servers.append(_ready(proc, tuple(argv), timeout))
    except BaseException:
        for proc in procs[len(servers) :]:
            if proc.poll() is None:
                proc.kill()
        for server in servers:
            server.stop()
        raise
    return servers


def _spawn(args: tuple[str, ...], extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", *args],
        stdout=subprocess.PIPE,
        stderr=None,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def _ready(proc: subprocess.Popen[str], args: tuple[str, ...], timeout: float) -> Server:
    """Wait for ``proc``'s ready line (killing it on a failure)."""
    assert proc.stdout is not None
    lines: list[str] = []
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
            break
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "kvstore ready" in line:
            sel.close()
            addrs = dict(re.findall(r"(\w+)=(\S+)", line))
            return Server(proc, addrs, lines)
    sel.close()
    proc.kill()
    out, _ = proc.communicate(timeout=5)
    raise RuntimeError(f"kvstore {' '.join(args)} did not become ready: {''.join(lines)}{out}")


async def node_stats(data_uri: str) -> dict[str, Any]:
    """A node's own counters (slots, pinned slots, leases ...) from its data port."""
    return await NodeClient(data_uri, timeout_s=5).stats()


def rpc_count(server: Server, method: str) -> float:
    """How many ``method`` RPCs the master of ``server`` has served (from its /metrics)."""
    url = f"http://{server.addresses['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    pattern = rf'^kvstore_rpc_seconds_count\{{method="{method}"\}} (\S+)$'
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


@contextmanager
def serving(host_mem: str, transport: str = "tcp") -> Iterator[Server]:
    """``kvstore serve`` on free ports for the ``with`` body; on exit it must stop cleanly
    with no slot left pinned."""
    srv = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port", "0",
                       "--host-mem", host_mem, "--transport", transport)  # fmt: skip
    yield srv
    rc, out = srv.stop()
    assert rc == 0 and "pinned_slots=0" in out, out

"""kvstore beside its peers: ``tcp://`` puts and gets next to Mooncake Store's, same run.

    python bench/peers.py [--quick] [--sizes "512 KiB,4 MiB"] [--batches 8] [--plot out.png]
                          [--master-apart]

Both stores move the same exchanges: N chunks of the same encoded size, from and into
memory the client allocated and touched beforehand, one exchange at a time:

- **kvstore**: a ``kvstore serve`` on loopback (pool ``--pool``; with ``--master-apart`` a
  ``kvstore master`` and a ``kvstore node``, each a process of its own, as Mooncake's master
  is, so that every put's commit crosses gRPC) and this process as the
  client, ``NodeClient.put`` (``put + chunks → ack``) and ``NodeClient.get`` (``get →
  data``, straight into the client's rows) of pre-encoded chunks (``quant="none"``) over one
  kept ``tcp://`` connection;
- **Mooncake Store** (``mooncake-transfer-engine-non-cuda``, its TCP transport): a
  ``mooncake_master`` on loopback with its HTTP metadata server, a *decode* process that
  mounts a segment of ``--pool`` bytes (where every object lands) and a *prefill* process
  with no segment of its own that ``batch_put_from`` / ``batch_get_into`` its registered
  buffer, one batch of N objects per exchange. Every address it is given is loopback
  (``MC_TCP_BIND_ADDRESS=127.0.0.1`` too), though 0.3.13 still listens on all interfaces
  for its HTTP metadata server and its clients' RPC and TCP ports;
- **raw sockets**, the ceiling of a store written on asyncio: a plain asyncio server in a
  process of its own (``bench/_common.py``'s ``serve_raw_sockets``) and this process moving
  the same rows with ``sock_sendall`` / ``sock_recv_into`` (a 9-byte header, the bytes, a
  1-byte ack per put): no framing, no allocation, no check, no index.

A round, per chunk size and side: a put phase (``--budget`` bytes of fresh keys), then a get
phase reading them back in the same order, then the store is emptied (untimed: kvstore
``evict``, Mooncake ``remove_all``). GB/s is a phase's bytes over its wall time; each figure
is the best of ``--rounds`` rounds, the sides alternating which goes first. The last
exchange of each get phase is checked against what was put (untimed). Each side first puts
and empties one round's bytes, untimed, so both work in touched memory. A second table
gives the CPU per GB each side spent in each phase: its server (the processes holding the
memory, read from ``/proc``) and its client.

Mooncake is a benchmark-only dependency: this script installs it into a virtualenv of its own
(``--mooncake-venv``, by default under the user's cache directory, outside the repository),
with ``pip install mooncake-transfer-engine-non-cuda==0.3.13.post1``, and Debian's
``libibverbs1`` (which its libraries link) by ``apt-get`` when missing and run as root. When
Mooncake cannot be installed or started, the table says why and shows kvstore's side alone.
Markdown goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import inspect
import json
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from _common import (
    BarPanel,
    BenchError,
    KeptConnection,
    ProcStat,
    SpawnedServer,
    Table,
    expect,
    print_report,
    proc_stat,
    progress,
    raw_socket_connect,
    raw_socket_get,
    raw_socket_put,
    save_bar_plot,
    serve_raw_sockets,
    start_pool,
)
from transfer import MAX_EXCHANGE, SIZES, D, H, Point, block_keys, points

from kvstore.core.arena import parse_size
from kvstore.core.codec import ChunkKey, encode_blocks, verify_chunk
from kvstore.dataplane import ChunkRef, NodeClient, PutChunk
from kvstore.transport import Connection, connect

MiB = 1 << 20
MOONCAKE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
"""The Mooncake build measured: PyPI's CPU-only wheel (TCP transport; links libibverbs)."""
MARK = "peers>"
"""Prefix of the lines a Mooncake process answers with on stdout (the rest is its logs)."""
IO_TIMEOUT_S = 60.0
START_TIMEOUT_S = 60.0
ROUND_TIMEOUT_S = 300.0
PIP_TIMEOUT_S = 900.0
APT_TIMEOUT_S = 300.0
FLUSH = 64 * MiB
"""Bytes written after encoding to push the encoded chunks out of the CPU caches."""
OPS = ("put", "get")
SIDES = ("kvstore", "Mooncake", "raw sockets")


class MooncakeUnavailable(BenchError):
    """Mooncake Store could not be installed, started or measured (the message says why)."""


def default_venv(package: str) -> Path:
    """Where the virtualenv of pip requirement ``package`` goes by default:
    ``$XDG_CACHE_HOME`` (``~/.cache``) ``/kvstore-bench/<package>``, outside the repository
    (no linter or test walks it); one per requirement, so each keeps its own build."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvstore-bench" / re.sub(r"[^\w.]+", "-", package)


# ----------------------------------------------------------------------- what each round moves


@dataclass(frozen=True)
class Plan:
    """The exchanges of one point in a phase (``n`` of them, each ``point.exchange_bytes``)."""

    point: Point
    n: int

    @property
    def nbytes(self) -> int:
        return self.n * self.point.exchange_bytes


def plans(pts: Sequence[Point], budget: int, min_n: int) -> list[Plan]:
    """Exchanges per phase: about ``budget`` bytes, at least ``min_n`` exchanges."""
    return [Plan(p, max(min_n, budget // p.exchange_bytes)) for p in pts]


ROLES = ("server", "client")
"""Whose CPU a phase is billed: the side that holds the memory (kvstore's node with its
master, the raw server, Mooncake's decode with its master) and the side that puts and gets."""


@dataclass
class Phases:
    """One round of one side: wall seconds of its put and get phases and the CPU seconds
    each role spent in each (all threads of its processes, over the phase)."""

    put_s: float
    get_s: float
    cpu: dict[tuple[str, str], float]
    """(op, role) → CPU seconds."""


@dataclass
class Results:
    """GB/s and CPU s/GB of every round, by (point name, op, side) and role; why Mooncake is
    missing, if it is."""

    plans: list[Plan]
    rounds: int
    gbps: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)
    cpu: dict[tuple[str, str, str, str], list[float]] = field(default_factory=dict)
    mooncake_error: str = ""

    def add(self, plan: Plan, side: str, phases: Phases) -> None:
        gb = plan.nbytes / 1e9
        for op, seconds in zip(OPS, (phases.put_s, phases.get_s), strict=True):
            self.gbps.setdefault((plan.point.name, op, side), []).append(gb / seconds)
            for role in ROLES:
                key = (plan.point.name, op, side, role)
                self.cpu.setdefault(key, []).append(phases.cpu[op, role] / gb)

    def best(self, plan: Plan, op: str, side: str) -> float | None:
        runs = self.gbps.get((plan.point.name, op, side))
        return max(runs) if runs else None

    def least_cpu(self, plan: Plan, op: str, side: str, role: str) -> float | None:
        """The round with the least CPU per GB (as GB/s, the best of the rounds)."""
        runs = self.cpu.get((plan.point.name, op, side, role))
        return min(runs) if runs else None


class CpuWatch:
    """CPU of the server's processes (``/proc``) and of this process (``process_time``)
    over a stretch: :meth:`start`, then :meth:`stop` → (server, client) seconds."""

    def __init__(self, server_pids: Sequence[int]) -> None:
        self.pids = list(server_pids)
        self._at: tuple[list[ProcStat], float] = ([], 0.0)

    def _now(self) -> tuple[list[ProcStat], float]:
        return [proc_stat(p) for p in self.pids], time.process_time()

    def start(self) -> None:
        self._at = self._now()

    def stop(self) -> tuple[float, float]:
        """(server, client) CPU seconds since :meth:`start`; the server's from each
        thread's schedstat (a difference of two readings), not clock ticks."""
        now = self._now()
        server = sum((b - a).cpu_s for a, b in zip(self._at[0], now[0], strict=True))
        return server, now[1] - self._at[1]


# ----------------------------------------------------------------------- kvstore's side


class KvSide:
    """This process as a kvstore client of one node: one kept ``tcp://`` connection and a
    ``region`` of touched memory, exchange ``i`` of a phase in its ``i``-th row block."""

    def __init__(self, conn: Connection, data_uri: str, region_bytes: int,
                 server_pids: Sequence[int]) -> None:  # fmt: skip
        self.conn = conn
        self.watch = CpuWatch(server_pids)
        self.node = NodeClient(data_uri, KeptConnection(conn), timeout_s=IO_TIMEOUT_S)
        self.region = torch.zeros(region_bytes, dtype=torch.uint8)  # written: pages touched
        self.scratch = torch.zeros(FLUSH, dtype=torch.uint8)
        self.sources: dict[Point, torch.Tensor] = {}

    @classmethod
    async def open(cls, data_uri: str, region_bytes: int, server_pids: Sequence[int]) -> KvSide:
        conn = await connect(data_uri, timeout=IO_TIMEOUT_S)
        return cls(conn, data_uri, region_bytes, server_pids)

    def rows(self, plan: Plan, i: int) -> torch.Tensor:
        """``[batch, chunk_bytes]``: exchange ``i``'s chunks in the region."""
        p = plan.point
        rows = self.region[i * p.exchange_bytes : (i + 1) * p.exchange_bytes]
        return rows.view(p.batch, p.chunk_bytes)

    def encode(self, plan: Plan, tag: str) -> list[list[bytes]]:
        """Encode every exchange of a phase (fresh keys from ``tag``) into its rows, then
        flush the caches; each exchange's block hashes."""
        p = plan.point
        if p not in self.sources:  # (under quant "none" the content is moot)
            self.sources[p] = torch.randn(2, p.batch * p.tokens, H, D).bfloat16()
        keys = [block_keys(tag, i, p.batch) for i in range(plan.n)]
        for i, ks in enumerate(keys):
            chunk_keys = [ChunkKey(k, 0, 0) for k in ks]
            encode_blocks(self.sources[p], p.tokens, chunk_keys, "none", out=self.rows(plan, i))
        self.scratch.add_(1)
        return keys

    async def round(self, plan: Plan, tag: str) -> Phases:
        """A put phase, a get phase (checked), the namespace evicted."""
        p, keys = plan.point, self.encode(plan, tag)
        ns = p.namespace()
        ns_bytes, ns_id = ns.canonical_bytes(), ns.id
        bufs = [[r.numpy() for r in self.rows(plan, i)] for i in range(plan.n)]
        puts = [tuple(PutChunk(k, None, 0, p.chunk_bytes) for k in ks) for ks in keys]
        gets = [[ChunkRef(k, 0) for k in ks] for ks in keys]
        cpu: dict[tuple[str, str], float] = {}
        self.watch.start()
        t0 = time.perf_counter()
        for chunks, views in zip(puts, bufs, strict=True):
            ack = await self.node.put(ns_bytes, chunks, views)
            expect(ack.stored == p.batch, f"kvstore stored {ack.stored} of {p.batch} chunks")
        put_s = time.perf_counter() - t0
        cpu["put", "server"], cpu["put", "client"] = self.watch.stop()
        self.rows(plan, plan.n - 1).zero_()  # what the last get brings must come from the node
        intos = [_into(views) for views in bufs]
        self.watch.start()
        t0 = time.perf_counter()
        for refs, into in zip(gets, intos, strict=True):
            found = await self.node.get(ns_id, refs, into)
            expect(len(found) == p.batch, f"kvstore found {len(found)} of {p.batch} chunks")
        get_s = time.perf_counter() - t0
        cpu["get", "server"], cpu["get", "client"] = self.watch.stop()
        for k, row in zip(keys[-1], self.rows(plan, plan.n - 1), strict=True):
            verify_chunk(row, expect_key=ChunkKey(k, 0, 0))
        await self.node.evict(ns_id)
        return Phases(put_s, get_s, cpu)

    async def close(self) -> None:
        await self.conn.close()


def _into(views: list[Any]) -> Callable[[list[int]], list[Any]]:
    """``NodeClient.get``'s ``into``: these buffers, whatever was found (checked after)."""
    return lambda _found: views


# ----------------------------------------------------------------------- raw sockets


class RawSide:
    """The same exchanges over plain asyncio sockets to a :func:`serve_raw_sockets` server,
    from and into ``kv``'s rows (the server writes puts into, and reads gets from, touched
    memory of its own)."""

    def __init__(self, server: SpawnedServer, kv: KvSide) -> None:
        self.sock = raw_socket_connect(server.address, IO_TIMEOUT_S)
        self.kv = kv
        self.watch = CpuWatch([server.pid])

    async def round(self, plan: Plan, tag: str) -> Phases:
        """A put phase, then a get phase (``tag`` unused: nothing is kept)."""
        del tag
        bufs = [[memoryview(r.numpy()) for r in self.kv.rows(plan, i)] for i in range(plan.n)]
        cpu: dict[tuple[str, str], float] = {}
        seconds = []
        for op, exchange in (("put", raw_socket_put), ("get", raw_socket_get)):
            self.watch.start()
            t0 = time.perf_counter()
            for views in bufs:
                await asyncio.wait_for(exchange(self.sock, views), IO_TIMEOUT_S)
            seconds.append(time.perf_counter() - t0)
            cpu[op, "server"], cpu[op, "client"] = self.watch.stop()
        return Phases(seconds[0], seconds[1], cpu)

    def close(self) -> None:
        self.sock.close()


# ----------------------------------------------------------------------- Mooncake's side


def mooncake_process(role: str, config: str) -> None:
    """A Mooncake Store client; runs in the Mooncake virtualenv, which has neither kvstore
    nor this module: its source is sent there, so it uses the standard library and
    ``mooncake`` alone. ``config``: JSON with ``master`` and ``metadata`` (addresses),
    ``pool`` and ``region`` (bytes) and ``mark`` (prefix of its answers on stdout).

    ``decode`` mounts a segment of ``pool`` bytes and holds it until stdin closes.
    ``prefill`` mounts none (every object lands in the decode's segment, over TCP),
    registers a touched buffer of ``region`` bytes, then answers one JSON command per stdin
    line: ``{"chunk", "batch", "n", "tag", "servers"}``: ``n`` exchanges of
    ``batch_put_from`` of ``batch`` objects of ``chunk`` bytes (fresh keys), then
    ``batch_get_into`` of the same in the same order, then ``remove_all``; it answers
    ``put_s`` and ``get_s`` (wall seconds of each phase) and ``cpu`` (per phase, the CPU
    seconds of the ``servers`` pids and of this process), or ``error``."""
    import ctypes
    import json
    import os
    import sys
    import time

    def used(pids: list[int]) -> tuple[float, float]:
        total = 0.0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total, time.process_time()

    from mooncake.store import MooncakeDistributedStore

    cfg = json.loads(config)

    def say(**answer: object) -> None:
        print(cfg["mark"], json.dumps(answer), flush=True)

    store = MooncakeDistributedStore()
    segment = cfg["pool"] if role == "decode" else 0
    rc = store.setup("127.0.0.1", cfg["metadata"], segment, 0, "tcp", "", cfg["master"])
    if rc != 0:
        say(error=f"{role}: setup returned {rc}")
        return
    if role == "decode":
        say(ready=role)
        sys.stdin.read()  # until the bench closes it
        store.close()
        return
    region = ctypes.create_string_buffer(cfg["region"])
    ctypes.memset(region, 1, cfg["region"])  # written: pages touched
    base = ctypes.addressof(region)
    rc = store.register_buffer(base, cfg["region"])
    if rc != 0:
        say(error=f"register_buffer returned {rc}")
        return
    say(ready=role)

    def run_round(
        chunk: int, batch: int, n: int, tag: str, servers: list[int]
    ) -> dict[str, object]:
        keys = [[f"{tag}/{i}/{j}" for j in range(batch)] for i in range(n)]
        ptrs = [[base + (i * batch + j) * chunk for j in range(batch)] for i in range(n)]
        sizes, last, nbytes = [chunk] * batch, ptrs[-1][0], batch * chunk
        for ks, ps in zip(keys, ptrs, strict=True):  # each object starts with its key
            for k, p in zip(ks, ps, strict=True):
                ctypes.memmove(p, k.encode(), len(k))
        cpu = {}
        c0, t0 = used(servers), time.perf_counter()
        for ks, ps in zip(keys, ptrs, strict=True):
            codes = store.batch_put_from(ks, ps, sizes)
            if any(codes):
                raise RuntimeError(f"batch_put_from answered {codes}")
        put_s = time.perf_counter() - t0
        c1 = used(servers)
        cpu["put"] = [c1[0] - c0[0], c1[1] - c0[1]]
        sent = ctypes.string_at(last, nbytes)
        ctypes.memset(last, 0, nbytes)  # what the last get brings must come from the decode
        c0, t0 = used(servers), time.perf_counter()
        for ks, ps in zip(keys, ptrs, strict=True):
            got = store.batch_get_into(ks, ps, sizes)
            if got != sizes:
                raise RuntimeError(f"batch_get_into answered {got}")
        get_s = time.perf_counter() - t0
        c1 = used(servers)
        cpu["get"] = [c1[0] - c0[0], c1[1] - c0[1]]
        if ctypes.string_at(last, nbytes) != sent:
            raise RuntimeError("the last get brought other bytes than were put")
        store.remove_all(True)
        return {"put_s": put_s, "get_s": get_s, "cpu": cpu}

    for line in sys.stdin:
        try:
            say(**run_round(**json.loads(line)))
        except Exception as e:
            say(error=f"{type(e).__name__}: {e}")
    store.close()


@dataclass
class Child:
    """A Mooncake subprocess: stdin and stdout pipes (binary), stderr to a temporary file;
    ``grace``: seconds it is given to exit once its stdin is closed."""

    name: str
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    grace: float = 10.0
    pending: bytes = b""

    @classmethod
    def start(cls, name: str, argv: Sequence[str], grace: float = 10.0) -> Child:
        log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by stop())
        env = dict(os.environ)
        env.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # (what it announces to peers)
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, bufsize=0, env=env)  # fmt: skip
        return cls(name, proc, log, grace)

    def tail(self, lines: int = 3) -> str:
        """The last ``lines`` lines of its stderr (its logs), on one line."""
        if self.log.closed:
            return ""
        self.log.seek(0)
        text = self.log.read()[-4000:].decode(errors="replace")
        return " | ".join(line.strip() for line in text.splitlines()[-lines:])

    def fail(self, what: str) -> MooncakeUnavailable:
        return MooncakeUnavailable(f"{self.name}: {what}; its log ends: {self.tail()}")

    def answer(self, timeout: float) -> dict[str, Any]:
        """Its next ``MARK`` line as JSON, within ``timeout`` s; raises
        :class:`MooncakeUnavailable` on an ``error`` answer, on EOF and on the timeout."""
        out = self.proc.stdout
        assert out is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            while True:
                line, nl, rest = self.pending.partition(b"\n")
                if nl:
                    self.pending = rest
                    text = line.decode(errors="replace")
                    if not text.startswith(MARK):
                        continue
                    answer: dict[str, Any] = json.loads(text[len(MARK) :])
                    if "error" in answer:
                        raise self.fail(str(answer["error"]))
                    return answer
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    raise self.fail(f"no answer within {timeout:.0f} s")
                chunk = os.read(out.fileno(), 1 << 16)
                if not chunk:
                    raise self.fail(f"exited ({self.proc.wait(5)})")
                self.pending += chunk

    def ask(self, timeout: float, **command: object) -> dict[str, Any]:
        """Send one JSON command line; its answer (as :meth:`answer`)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        except OSError as e:
            raise self.fail(f"cannot be written to ({e})") from e
        return self.answer(timeout)

    def stop(self) -> None:
        """Close its stdin (a client leaves), SIGTERM after ``grace`` s, SIGKILL after 5
        more. Idempotent."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(self.grace)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def _run_quiet(argv: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``argv``; its output. Raises :class:`MooncakeUnavailable` (with the output's tail)
    when it fails or runs past ``timeout`` s."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              env=env, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MooncakeUnavailable(f"`{' '.join(argv)}` failed: {e}") from e
    out = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        why = [line for line in lines if line.startswith(("ERROR", "E:"))] or lines[-3:]
        raise MooncakeUnavailable(f"`{' '.join(argv)}` exited {done.returncode}: "
                                  f"{' '.join(why)[-1500:]}")  # fmt: skip
    return out


def _import_error(python: Path) -> str:
    """Empty when ``python`` imports ``mooncake.store``, else why not."""
    try:
        _run_quiet([str(python), "-c", "import mooncake.store"], 120)
    except MooncakeUnavailable as e:
        return str(e)
    return ""


def install_mooncake(venv: Path, package: str, step: Callable[[str], None]) -> Path:
    """The Python of ``venv`` with ``package`` importable: the virtualenv is created and the
    package installed by pip when missing, Debian's ``libibverbs1`` by apt-get when the
    import misses ``libibverbs.so.1`` (as root). Raises :class:`MooncakeUnavailable`."""
    python = venv / "bin" / "python"
    if python.exists() and not _import_error(python):
        return python
    if not python.exists():
        step(f"creating {venv}")
        _run_quiet([sys.executable, "-m", "venv", str(venv)], 300)
    step(f"pip install {package} into {venv}")
    _run_quiet([str(python), "-m", "pip", "install", "-q", package], PIP_TIMEOUT_S)
    why = _import_error(python)
    if "libibverbs" in why:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise MooncakeUnavailable(f"Mooncake needs Debian's libibverbs1 (apt-get install "
                                      f"libibverbs1, as root): {why}")  # fmt: skip
        step("apt-get install libibverbs1")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        apt = ["apt-get", "install", "-y", "-q", "libibverbs1"]
        try:
            _run_quiet(apt, APT_TIMEOUT_S, env)
        except MooncakeUnavailable:  # an old or empty package list: refresh it once
            _run_quiet(["apt-get", "update", "-q"], APT_TIMEOUT_S, env)
            _run_quiet(apt, APT_TIMEOUT_S, env)
        why = _import_error(python)
    if why:
        raise MooncakeUnavailable(why)
    return python


def _free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free right now (a binary takes them after)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _wait_listening(child: Child, ports: Sequence[int], timeout: float) -> None:
    """Until every port accepts a connection; raises when ``child`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    for port in ports:
        while True:
            if child.proc.poll() is not None:
                raise child.fail(f"exited ({child.proc.returncode})")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline:
                raise child.fail(f"port {port} not listening after {timeout:.0f} s")
            time.sleep(0.1)


class MooncakeSide:
    """A ``mooncake_master``, a decode (the segment) and a prefill (the client), started
    with :meth:`start` on loopback; always :meth:`stop`."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.prefill: Child | None = None

    def start(self, python: Path, pool: int, region: int) -> None:
        """Start the three processes (each wait bounded). Raises :class:`MooncakeUnavailable`."""
        rpc, http, metrics = _free_ports(3)
        master = Child.start("mooncake_master", [
            str(python.with_name("mooncake_master")), f"--rpc_port={rpc}",
            "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
            "--metrics_host=127.0.0.1", f"--metrics_port={metrics}",
        ], grace=0)  # fmt: skip
        self.children.append(master)
        _wait_listening(master, (rpc, http), START_TIMEOUT_S)
        metadata = f"http://127.0.0.1:{http}/metadata"
        config = json.dumps({"master": f"127.0.0.1:{rpc}", "metadata": metadata, "pool": pool,
                             "region": region, "mark": MARK})  # fmt: skip
        code = inspect.getsource(mooncake_process) + "\nimport sys\n"
        code += "mooncake_process(*sys.argv[1:])\n"
        for role in ("decode", "prefill"):  # (the decode's segment first: puts land there)
            child = Child.start(f"mooncake {role}", [str(python), "-c", code, role, config])
            self.children.append(child)
            child.answer(START_TIMEOUT_S)
        self.prefill = self.children[-1]

    async def round(self, plan: Plan, tag: str) -> Phases:
        """One round (see :func:`mooncake_process`). Blocks the event loop meanwhile
        (nothing else runs)."""
        if self.prefill is None:
            raise MooncakeUnavailable("not started")
        p = plan.point
        servers = [c.proc.pid for c in self.children if c is not self.prefill]
        answer = self.prefill.ask(ROUND_TIMEOUT_S, chunk=p.chunk_bytes, batch=p.batch,
                                  n=plan.n, tag=tag, servers=servers)  # fmt: skip
        cpu = {(op, role): float(answer["cpu"][op][k])
               for op in OPS for k, role in enumerate(ROLES)}  # fmt: skip
        return Phases(float(answer["put_s"]), float(answer["get_s"]), cpu)

    def stop(self) -> None:
        """Stop the clients, then the master (reverse order). Idempotent."""
        while self.children:
            self.children.pop().stop()
        self.prefill = None


# ----------------------------------------------------------------------- orchestration


Round = Callable[[Plan, str], Awaitable[Phases]]
"""A side's round of one plan (keys made of the tag): its put and get phases."""


async def run(args: argparse.Namespace) -> Results:
    """Install and start everything, measure, stop everything (also on failure). Whatever
    goes wrong on Mooncake's side is reported in the results; kvstore's is still measured."""
    todo = plans(points(args.sizes, args.batches), args.budget, args.min_n)
    res = Results(todo, args.rounds)
    region = max(plan.nbytes for plan in todo)
    mooncake = MooncakeSide()
    with contextlib.ExitStack() as stack, progress() as bar:
        stack.callback(mooncake.stop)
        total = 5 + args.rounds * len(todo) * len(SIDES)
        task = bar.add_task("Mooncake", total=total)

        def step(what: str, advance: int = 1) -> None:
            bar.update(task, advance=advance, description=what)

        def failed(e: Exception) -> None:
            res.mooncake_error = f"{type(e).__name__}: {e}"
            bar.console.print(f"[red]Mooncake Store failed[/red]: {res.mooncake_error}")
            mooncake.stop()

        if args.no_mooncake:
            res.mooncake_error = "left out (--no-mooncake)"
        else:
            try:
                step("installing Mooncake", 0)
                python = install_mooncake(args.mooncake_venv, args.mooncake_package,
                                          lambda what: step(what, 0))  # fmt: skip
                step("starting Mooncake Store: master, decode, prefill")
                mooncake.start(python, args.pool_bytes, region)
            except Exception as e:  # (any failure: the bench goes on without Mooncake)
                failed(e)
        # --master-apart: as Mooncake's, the master a process of its own
        step("starting kvstore master and node" if args.master_apart else "starting kvstore serve")
        serve, master = start_pool(stack, "--host-mem", args.pool, apart=args.master_apart,
                                   mapped=True)  # fmt: skip
        pids = [serve.proc.pid, *([master.proc.pid] if master is not None else [])]
        kv = await KvSide.open(serve.addresses["data"], region, pids)
        step("starting the raw socket server")
        raw_server = SpawnedServer.start(
            functools.partial(serve_raw_sockets, region_bytes=region), START_TIMEOUT_S
        )
        stack.callback(raw_server.stop)
        raw = RawSide(raw_server, kv)
        stack.callback(raw.close)
        sides: dict[str, Round] = {"kvstore": kv.round, "raw sockets": raw.round}
        if not res.mooncake_error:
            sides["Mooncake"] = mooncake.round

        async def measure(side: str, plan: Plan, tag: str) -> Phases | None:
            try:
                return await sides[side](plan, tag)
            except Exception as e:
                if side != "Mooncake":
                    raise
                failed(e)
                del sides[side]
                return None

        try:
            step("one untimed round per side, so that pages are touched")
            for side in list(sides):
                await measure(side, max(todo, key=lambda plan: plan.nbytes), "fill")
            for r in range(args.rounds):
                for k, plan in enumerate(todo):
                    for side in SIDES if (r + k) % 2 == 0 else SIDES[::-1]:
                        step(f"round {r + 1} of {args.rounds}: {plan.point.name}, {side}")
                        tag = f"round {r}/{plan.point.name}"
                        if side in sides and (phases := await measure(side, plan, tag)):
                            res.add(plan, side, phases)
        finally:
            await kv.close()
        bar.update(task, completed=total, description="stopped")
    return res


def report(res: Results, args: argparse.Namespace) -> Table:
    """The Markdown table: each exchange, each side's best GB/s and their ratios."""
    table = Table(
        "kvstore tcp:// beside Mooncake Store (TCP transport) and raw asyncio sockets: the "
        "same exchanges, GB/s",
        ["exchange", "kvstore GB/s", "Mooncake GB/s", "raw sockets GB/s", "kvstore ÷ Mooncake",
         "raw ÷ Mooncake", "kvstore ÷ raw"],
    )  # fmt: skip
    for plan in res.plans:
        for op in OPS:
            kv, mc, raw = (res.best(plan, op, side) for side in SIDES)
            table.add(f"{op} {plan.point.name}", _gbps(kv), _gbps(mc), _gbps(raw),
                      _ratio(kv, mc), _ratio(raw, mc), _ratio(kv, raw))  # fmt: skip
    if res.mooncake_error:
        partly = any(side == "Mooncake" for _, _, side in res.gbps)
        what = "stopped part-way (its figures: the rounds before)" if partly else "not measured"
        table.notes.append(f"**Mooncake Store {what}**: {res.mooncake_error}")
    phases = [f"{p.n} exchanges of {p.point.name} ({p.nbytes / MiB:.0f} MiB)" for p in res.plans]
    rounds = f"{res.rounds} round{'s' * (res.rounds != 1)}"
    table.notes += [
        f"Each figure: the best of {rounds} of a phase's bytes over its wall time, "
        "one exchange at a time, the sides taking turns to go first. A phase: "
        f"{'; '.join(phases)}.",
        "A chunk is kvstore's encoded chunk (the payload and its header, quant none); "
        "Mooncake's objects have the same size, so both move the same bytes.",
        (
            f"kvstore: `kvstore node --host-mem {args.pool}` with a `kvstore master` in a "
            "process of its own (--master-apart: every put's commit crosses gRPC, as Mooncake's "
            "puts reach its master)"
            if args.master_apart
            else f"kvstore: `kvstore serve --host-mem {args.pool}` (its master in the node's "
            "process)"
        )
        + " on loopback, measured once its node "
        "said its host memory was mapped, this process as the client on one kept connection "
        "(`NodeClient.put`: put + chunks → ack; `NodeClient.get`: get → data into the "
        "client's rows).",
        f"Mooncake Store: `{args.mooncake_package}` (its TCP transport) in "
        f"`{args.mooncake_venv}`; `mooncake_master` with its HTTP metadata server on "
        f"loopback, a decode process mounting a {args.pool} segment, a "
        "prefill process with none (`batch_put_from` / `batch_get_into` of its registered "
        "buffer, one batch per exchange).",
        "After each round the store is emptied (kvstore `evict`, Mooncake `remove_all`), "
        "untimed: puts land in free, touched memory on both sides.",
        "raw sockets: a plain asyncio server in a process of its own, `sock_sendall` / "
        "`sock_recv_into` of the same rows, a 9-byte header per exchange and a 1-byte ack "
        "per put; no framing, allocation, checks or index: what a store written on asyncio "
        "can reach here at most, so raw ÷ Mooncake bounds kvstore ÷ Mooncake.",
    ]
    return table


def cpu_report(res: Results) -> Table:
    """CPU seconds per GB moved, each side's server and client, each exchange."""
    table = Table(
        "CPU per GB moved (s/GB): the side holding the memory (server) and the one putting "
        "and getting (client)",
        ["exchange", *(f"{side} {role}" for side in SIDES for role in ROLES)],
    )
    for plan in res.plans:
        for op in OPS:
            cells = [res.least_cpu(plan, op, side, role) for side in SIDES for role in ROLES]
            table.add(f"{op} {plan.point.name}", *("-" if c is None else f"{c:.3f}"
                                                   for c in cells))  # fmt: skip
    table.notes += [
        "Each figure: the round with the least CPU per GB (of the same rounds as the GB/s "
        "above); CPU of every thread, user and system, over the phase: the server's from "
        "/proc (each thread's schedstat), the client's from its process time.",
        "server: kvstore's `serve` (its node and its master in one process) or, with "
        "--master-apart, its node and master processes; the raw socket "
        "server, Mooncake's decode process and its `mooncake_master`. client: this process "
        "(kvstore, raw sockets) or Mooncake's prefill process.",
        "Over loopback TCP a put's kernel copy into the server is billed to the server, a "
        "get's to the client; the raw server's figure is that copy plus asyncio, the least a "
        "server on sockets spends here.",
    ]
    return table


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def plot(res: Results, path: str) -> None:
    """Best GB/s per exchange and store: puts, then gets."""
    labels = [plan.point.name for plan in res.plans]
    panels = []
    for op in OPS:
        best = {side: [res.best(plan, op, side) for plan in res.plans] for side in SIDES}
        series = {side: [v or 0.0 for v in values] for side, values in best.items() if any(values)}
        panels.append(BarPanel(f"{op}, GB/s (best of {res.rounds})", "GB/s", labels, series))
    title = "bench/peers.py: kvstore tcp://, Mooncake Store, raw sockets"
    save_bar_plot(path, panels, suptitle=title)


# ----------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--quick`` shrinks every knob not given explicitly."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="under a minute: less per phase")
    parser.add_argument("--sizes", default="512 KiB,4 MiB",
                        help=f"chunk sizes, comma-separated, of: {', '.join(SIZES)}")  # fmt: skip
    parser.add_argument("--batches", default="8", help="chunks per exchange, comma-separated")
    parser.add_argument("--rounds", type=int, help="rounds per point; the best counts (3)")
    parser.add_argument("--budget", type=parse_size, help="bytes per phase (512MiB)")
    parser.add_argument("--min-n", type=int, default=4, help="fewest exchanges per phase (4)")
    parser.add_argument("--pool", default="1GiB",
                        help="kvstore's pool and Mooncake's segment (1GiB)")  # fmt: skip
    parser.add_argument("--mooncake-venv", type=Path, help="Mooncake's virtualenv, made "
                        f"when missing ({default_venv(MOONCAKE)})")  # fmt: skip
    parser.add_argument("--mooncake-package", default=MOONCAKE, help="what pip installs there")
    parser.add_argument("--no-mooncake", action="store_true", help="kvstore's side alone")
    parser.add_argument("--plot", metavar="PNG", help="also write a bar chart here")
    parser.add_argument("--master-apart", action="store_true",
                        help="kvstore's master in a process of its own, as Mooncake's is "
                             "(default: kvstore serve: master and node in one)")  # fmt: skip
    args = parser.parse_args(argv)
    args.sizes = [s.strip() for s in args.sizes.split(",")]
    if any(s not in SIZES for s in args.sizes):
        parser.error(f"--sizes takes {', '.join(SIZES)}")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.mooncake_venv = args.mooncake_venv or default_venv(args.mooncake_package)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.budget = args.budget or (128 * MiB if args.quick else 512 * MiB)
    if min(args.batches) < 1 or args.rounds < 1 or args.min_n < 1:
        parser.error("need batches >= 1, --rounds >= 1, --min-n >= 1")
    pts = points(args.sizes, args.batches)
    if not pts:
        parser.error(f"every size x batch exceeds {MAX_EXCHANGE // MiB} MiB per exchange")
    biggest = max(plan.nbytes for plan in plans(pts, args.budget, args.min_n))
    try:
        args.pool_bytes = parse_size(args.pool)
    except ValueError as e:
        parser.error(f"--pool: {e}")
    if biggest > args.pool_bytes * 3 // 4:
        parser.error(f"a phase moves {biggest / MiB:.0f} MiB: more than 3/4 of --pool "
                     f"(Mooncake refuses puts into a full segment); raise --pool")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print Markdown; 0 on success (also when Mooncake was not
    measured: the table says why)."""
    args = parse_args(argv)
    res = asyncio.run(run(args))
    tables = [report(res, args), cpu_report(res)]
    print_report("kvstore beside Mooncake Store", "bench/peers.py", argv, tables)
    if args.plot:
        plot(res, args.plot)
        print(f"Plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

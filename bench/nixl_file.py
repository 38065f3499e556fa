"""Staging a disk block for a ``ucx://`` reader: ``os.preadv`` into registered DRAM (what
the node does today) against NIXL's file backends reading a registered file.

    python bench/nixl_file.py [--dir PATH] [--total 128MiB] [--sizes "4 MiB,1 MiB"]
                              [--rounds 3] [--seed 0]

Three questions, in order:

1. **Which NIXL plugins load here**, with the memory types each takes (and, for one that
   does not load, the library it misses); which of the POSIX plugin's I/O queue modes
   (``use_aio``, ``use_uring``, ``use_posix_aio``) start on this kernel, the queue type NIXL
   reports for each (a child process with ``NIXL_LOG_LEVEL=INFO``), and whether a READ of a
   registered ``FILE_SEG`` into DRAM through each returns the file's bytes.
2. **Can a remote agent read a ``FILE_SEG`` over UCX** (a ``ucx://`` reader reading the
   node's segment file with no staging)? A spawned *owner* process (UCX + POSIX, progress
   thread) registers the file (by fd) and a DRAM buffer, and stages the block into that
   buffer with a local POSIX READ; this process (a *reader*: UCX alone, then UCX + POSIX)
   loads its metadata and tries a READ of the owner's ``FILE_SEG`` into its own DRAM, and,
   as a control, of the owner's staged DRAM. The owner also tries the push: a WRITE from its
   ``FILE_SEG`` into the reader's DRAM. NIXL's own words (its exception and the log line it
   writes on stderr) are shown.
3. **Local read speed**, per record size: ``--total`` bytes of records in one file, read
   in one random order into one registered, page-aligned DRAM region (each record to its
   own slot), by ``os.preadv`` with ``O_DIRECT`` (one call per record — the store's read of
   a record up to 4 MiB — and batches of 8 on 8 threads), and by a NIXL POSIX READ from the
   ``FILE_SEG`` (each working mode; one record per transfer, and 8 per transfer), each
   transfer created (``createXferReq``), posted, polled to completion and released, as a
   staging path would. NIXL is polled without pause (``getXferStatus`` in a loop: its
   latency floor, and a core busy while waiting), and for the default mode also every
   100 µs. Sides alternate, rotating which goes first, after a warm-up round; each side's
   fastest of ``--rounds`` is kept. Every round's bytes are checked against the file's.

CPU s/GB: this process's CPU seconds (``time.process_time``: every thread, NIXL's too) per
GB read. The file goes to a temporary directory in ``--dir`` (default: the current
directory; not a tmpfs, which refuses ``O_DIRECT``), deleted at exit. Markdown on stdout,
progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.metadata
import json
import mmap
import multiprocessing
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BenchError, Table, open_direct, percentile, print_report, progress

from kvstore.core.sizes import format_size, parse_size
from kvstore.transport.nixl_binding import import_bindings

MODES: dict[str, dict[str, str]] = {
    "aio": {"use_aio": "true"},
    "uring": {"use_uring": "true"},
    "posix_aio": {"use_posix_aio": "true"},
}
"""The POSIX plugin's I/O queue modes and the backend parameters that pick them."""
DEFAULT_MODE = "aio"
"""What the POSIX plugin picks when no mode is asked for (its log says which: checked)."""
BATCH = 8
"""Records per transfer in the batched rows."""
SLEEP_POLL_S = 100e-6
FASTER = 1.15
"""A GB/s ratio the conclusion calls faster (the disk's rounds vary by more than 1.2x)."""
DEADLINE_S = 30.0
"""Longest any transfer, reply or child process is waited for."""
ALIGN = 4096
PROBE_BYTES = 4 << 20
LOOPBACK = {"UCX_NET_DEVICES": "lo"}
PLUGIN_DIR = ".nixl_cu12.mesonpy.libs/plugins"
_LOG_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ (.*)$")


# ---- helpers -------------------------------------------------------------------------------


@contextlib.contextmanager
def stderr_lines() -> Iterator[list[str]]:
    """Capture what is written on file descriptor 2 (NIXL's C++ log) inside the block; the
    list is filled when it exits, one entry per non-empty line, log prefixes dropped."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines():
                if line.strip():
                    m = _LOG_LINE.match(line)
                    lines.append(m.group(1) if m else line.strip())


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[bool, Any, str]:
    """Call ``fn``: ``(True, value, log)`` or ``(False, None, "Error: message; log")``, the
    log being what NIXL wrote on stderr meanwhile."""
    with stderr_lines() as log:
        try:
            value, ok, msg = fn(*args, **kwargs), True, ""
        except Exception as exc:  # reported, not handled: NIXL's answer is the result
            value, ok, msg = None, False, f"{type(exc).__name__}: {exc}"
    said = "; ".join(f"`{line}`" for line in log)
    return ok, value, "; ".join(p for p in (msg and f"`{msg}`", said) if p)


def addr_of(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def wait_xfer(b: Any, agent: Any, handle: Any, sleep_s: float = 0.0) -> Any:
    """Post ``handle`` and poll it to its end (at most :data:`DEADLINE_S`); its status."""
    status = agent.postXferReq(handle)
    deadline = time.monotonic() + DEADLINE_S
    while status == b.NIXL_IN_PROG:
        if sleep_s:
            time.sleep(sleep_s)
        if time.monotonic() > deadline:
            raise BenchError(f"a NIXL transfer did not end in {DEADLINE_S:.0f} s")
        status = agent.getXferStatus(handle)
    return status


def read_file_seg(b: Any, agent: Any, peer: str, pairs: list[tuple[int, int]], size: int,
                  fd: int, sleep_s: float = 0.0) -> Any:  # fmt: skip
    """One READ of ``(file offset, DRAM address)`` pairs of ``size`` bytes; its status."""
    local = b.nixlXferDList(b.DRAM_SEG, [(addr, size, 0) for _, addr in pairs])
    remote = b.nixlXferDList(b.FILE_SEG, [(off, size, fd) for off, _ in pairs])
    handle = agent.createXferReq(b.NIXL_READ, local, remote, peer)
    status = wait_xfer(b, agent, handle, sleep_s)
    agent.releaseXferReq(handle)
    return status


def agent_name(mode: str) -> str:
    """The agent of a POSIX mode (a local transfer names its own agent as the peer)."""
    return f"nixl-file-{mode}"


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


# ---- 1. plugins and POSIX modes -------------------------------------------------------------


def plugins_table(b: Any) -> Table:
    agent = b.nixlAgent("nixl-file-plugins", b.nixlAgentConfig())
    version = importlib.metadata.version("nixl-cu12")
    table = Table(f"NIXL plugins (nixl-cu12 {version})",
                  ["plugin", "loads here", "memory types", "why not"])  # fmt: skip
    plugin_dir = Path(b.__file__).resolve().parent.parent / PLUGIN_DIR
    for name in agent.getAvailPlugins():
        ok, got, _ = attempt(agent.getPluginParams, name)
        if ok:
            table.add(name, "yes", ", ".join(got[1]), "")
            continue
        why = "getPluginParams: NIXL_ERR_NOT_FOUND"
        try:  # (dlopen says which library is missing)
            ctypes.CDLL(str(plugin_dir / f"libplugin_{name}.so"))
        except OSError as exc:
            why = str(exc).removeprefix(f"{plugin_dir / f'libplugin_{name}.so'}: ")
        table.add(name, "no", "", why)
    table.notes += [
        "the list: nixlAgent.getAvailPlugins() (the wheel's plugins directory); loads: "
        "getPluginParams(name) succeeds (the plugin's shared library opens); why not: "
        "dlopen's error for it",
        "remote access, from NIXL's source (ai-dynamo/nixl, src/plugins): the file "
        'backends POSIX, GDS and GDS_MT all return supportsRemote() false (GDS: "target is '
        'the distributed FS … just treat it locally"); UCX, the only remote backend here, '
        "takes DRAM_SEG and VRAM_SEG, not FILE_SEG",
    ]
    return table


_QUEUE_PROBE = """
import json, os, sys
import nixl_cu12._bindings as b
out = {}
for mode, params in json.loads(sys.argv[1]).items():
    agent = b.nixlAgent("q-" + mode, b.nixlAgentConfig())
    try:
        agent.createBackend("POSIX", params)
        out[mode] = "ok"
    except Exception as exc:
        out[mode] = f"{type(exc).__name__}: {exc}"
    sys.stderr.write(f"@@ {mode}\\n"); sys.stderr.flush()
print(json.dumps(out), flush=True)
os._exit(0)
"""


def queue_types() -> dict[str, str]:
    """The I/O queue type NIXL's POSIX backend reports for each mode (and ``default``, no
    parameter), from a child process logging at INFO."""
    modes = {"default": {}, **MODES}
    env = dict(os.environ, NIXL_LOG_LEVEL="INFO")
    try:
        out = subprocess.run(
            [sys.executable, "-c", _QUEUE_PROBE, json.dumps(modes)],
            capture_output=True,
            text=True,
            env=env,
            timeout=DEADLINE_S,
        )
    except subprocess.TimeoutExpired:
        return {}
    found: dict[str, str] = {}
    seen: list[str] = []
    for line in out.stderr.splitlines():
        if m := re.search(r"io queue type: (\w+)", line):
            seen.append(m.group(1))
        elif line.startswith("@@ "):
            found[line[3:]] = seen[-1] if seen else "?"
            seen.clear()
    return found


def modes_table(b: Any, root: Path) -> tuple[Table, dict[str, Any]]:
    """Each POSIX mode: does its backend start, what queue NIXL uses, does a READ of a
    registered ``FILE_SEG`` return the file's bytes. Returns the agents that work, by mode
    (each with the backend, for the timed rounds)."""
    table = Table("The POSIX backend's I/O queue modes (READ of a FILE_SEG into DRAM)",
                  ["mode", "backend parameters", "backend", "queue type NIXL reports",
                   f"{format_size(PROBE_BYTES)} READ verifies"])  # fmt: skip
    kinds = queue_types()
    data = os.urandom(PROBE_BYTES)
    path = root / "probe.bin"
    write_file(path, data)
    fd, _ = open_direct(path, os.O_RDONLY)
    buf = mmap.mmap(-1, PROBE_BYTES)
    working: dict[str, Any] = {}
    for mode, params in {"default": {}, **MODES}.items():
        agent = b.nixlAgent(agent_name(mode), b.nixlAgentConfig())
        ok, _, msg = attempt(agent.createBackend, "POSIX", params)
        shown = ", ".join(f"{k}={v}" for k, v in params.items()) or "(none)"
        if not ok:
            table.add(mode, shown, f"fails: {msg}", kinds.get(mode, "?"), "")
            continue
        regs = (b.nixlRegDList(b.DRAM_SEG, [(addr_of(buf), PROBE_BYTES, 0, "")]),
                b.nixlRegDList(b.FILE_SEG, [(0, PROBE_BYTES, fd, "")]))  # fmt: skip
        for dl in regs:
            agent.registerMem(dl)
        ctypes.memset(addr_of(buf), 0x5A, PROBE_BYTES)
        ok, status, msg = attempt(read_file_seg, b, agent, agent_name(mode), [(0, addr_of(buf))],
                                  PROBE_BYTES, fd)  # fmt: skip
        for dl in regs:  # (the fd closes below: its number may come back for another file)
            agent.deregisterMem(dl)
        good = ok and status == b.NIXL_SUCCESS and buf[:] == data
        verdict = "yes" if good else f"no: {msg or status}"
        table.add(mode, shown, "starts", kinds.get(mode, "?"), verdict)
        if good and mode != "default":
            working[mode] = agent
    os.close(fd)
    buf.close()
    table.notes += [
        "fd-mode registration: FILE_SEG descriptor (offset 0, file length, devId = the "
        "file's fd, opened O_RDONLY | O_DIRECT), READ into a page-aligned mmap registered "
        "as DRAM_SEG, on an agent with the POSIX backend alone",
        "queue type: the `POSIX backend initialized using io queue type: …` line of a "
        "child process run with NIXL_LOG_LEVEL=INFO (AIO: Linux libaio; URING: io_uring; "
        "POSIXAIO: glibc's aio_*, deprecated by NIXL)",
    ]
    return table, working


# ---- 2. remote FILE_SEG ---------------------------------------------------------------------


def owner_main(conn: Connection, path: str, nbytes: int) -> None:
    """The node stand-in: UCX + POSIX, progress thread; registers ``path`` (fd) and a DRAM
    buffer, stages the file's first ``nbytes`` into it, and answers the reader."""
    os.environ.update(LOOPBACK)
    code = 0
    try:
        _owner(conn, path, nbytes)
    except Exception as exc:
        code = 1
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    sys.exit(code)


def _owner(conn: Connection, path: str, nbytes: int) -> None:
    b = import_bindings()
    config = b.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = b.NIXL_THREAD_SYNC_RW
    agent = b.nixlAgent("file-owner", config)
    agent.createBackend("UCX", {})
    agent.createBackend("POSIX", {})
    fd, _ = open_direct(path, os.O_RDONLY)
    buf = mmap.mmap(-1, nbytes)
    agent.registerMem(b.nixlRegDList(b.DRAM_SEG, [(addr_of(buf), nbytes, 0, "")]))
    agent.registerMem(b.nixlRegDList(b.FILE_SEG, [(0, nbytes, fd, "")]))
    ok, status, msg = attempt(read_file_seg, b, agent, "file-owner", [(0, addr_of(buf))],
                              nbytes, fd)  # fmt: skip
    staged = f"`{status.name}`" if ok else msg
    conn.send(("ready", agent.getLocalMD(), addr_of(buf), fd, staged))
    while conn.poll(DEADLINE_S):
        cmd = conn.recv()
        if cmd[0] == "stop":
            return
        if cmd[0] == "push":  # WRITE from our FILE_SEG into the reader's DRAM
            _, md, remote_addr = cmd
            peer = agent.loadRemoteMD(md).decode()
            local = b.nixlXferDList(b.FILE_SEG, [(0, nbytes, fd)])
            remote = b.nixlXferDList(b.DRAM_SEG, [(remote_addr, nbytes, 0)])
            ok, _, msg = attempt(agent.createXferReq, b.NIXL_WRITE, local, remote, peer)
            conn.send(("pushed", "created" if ok else msg))
    raise BenchError("the reader went silent")


def _reply(conn: Connection) -> tuple[Any, ...]:
    if not conn.poll(DEADLINE_S):
        raise BenchError(f"the owner process did not answer in {DEADLINE_S:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise BenchError(f"the owner process failed: {msg[1]}")
    return msg


def remote_table(b: Any, root: Path) -> tuple[Table, bool]:
    """Try a remote READ of another process's FILE_SEG; returns the table and whether it
    worked (it would have to, for a ucx:// reader to skip staging)."""
    nbytes = PROBE_BYTES
    data = os.urandom(nbytes)
    path = root / "remote.bin"
    write_file(path, data)
    os.environ.update(LOOPBACK)
    ctx = multiprocessing.get_context("spawn")
    conn, there = ctx.Pipe()
    proc = ctx.Process(target=owner_main, args=(there, str(path), nbytes), daemon=True)
    proc.start()
    table = Table("Remote FILE_SEG: can a ucx:// reader read the node's file with no staging?",
                  ["step", "agent (backends)", "NIXL's answer"])  # fmt: skip
    remote_ok = False
    try:
        _, md, owner_addr, owner_fd, staged = _reply(conn)
        table.add("owner: local READ of its FILE_SEG into its DRAM (the staging)",
                  "file-owner (UCX, POSIX)", staged)  # fmt: skip
        for backends in (("UCX",), ("UCX", "POSIX")):
            name = "reader-" + "-".join(backends).lower()
            who = f"{name} ({', '.join(backends)})"
            agent = b.nixlAgent(name, b.nixlAgentConfig())
            handles = {k: agent.createBackend(k, {}) for k in backends}
            buf = mmap.mmap(-1, nbytes)
            agent.registerMem(b.nixlRegDList(b.DRAM_SEG, [(addr_of(buf), nbytes, 0, "")]))
            peer = agent.loadRemoteMD(md).decode()
            local = b.nixlXferDList(b.DRAM_SEG, [(addr_of(buf), nbytes, 0)])
            file_dl = b.nixlXferDList(b.FILE_SEG, [(0, nbytes, owner_fd)])
            dram_dl = b.nixlXferDList(b.DRAM_SEG, [(owner_addr, nbytes, 0)])
            ok, st, msg = attempt(agent.checkRemoteMD, peer, file_dl)
            table.add("reader: checkRemoteMD(owner, its FILE_SEG)", who,
                      f"`{st.name}`" if ok else msg)  # fmt: skip
            ok, handle, msg = attempt(agent.createXferReq, b.NIXL_READ, local, file_dl, peer)
            if ok:  # (not what NIXL 1.x does: then see whether it moves the bytes)
                ok, st, msg = attempt(wait_xfer, b, agent, handle)
                remote_ok = ok and st == b.NIXL_SUCCESS and buf[:] == data
                msg = f"created; {st.name if ok else msg}; verifies: {remote_ok}"
            table.add("reader: createXferReq(READ, its DRAM ← owner's FILE_SEG)", who, msg)
            if "POSIX" in handles:
                ok, _, msg = attempt(agent.createXferReq, b.NIXL_READ, local, file_dl, peer,
                                     "", [handles["POSIX"]])  # fmt: skip
                table.add("reader: the same, backend = its POSIX", who,
                          "created" if ok else msg)  # fmt: skip
            ok, handle, msg = attempt(agent.createXferReq, b.NIXL_READ, local, dram_dl, peer)
            if ok:
                ok, st, msg = attempt(wait_xfer, b, agent, handle)
                good = ok and st == b.NIXL_SUCCESS and buf[:] == data
                msg = f"`{st.name}`, bytes equal the file's: {good}" if ok else msg
            table.add("control: createXferReq(READ, its DRAM ← owner's staged DRAM)", who, msg)
            if backends == ("UCX",):
                conn.send(("push", agent.getLocalMD(), addr_of(buf)))
                table.add("owner: createXferReq(WRITE, its FILE_SEG → reader's DRAM)",
                          "file-owner (UCX, POSIX)", _reply(conn)[1])  # fmt: skip
        conn.send(("stop",))
    finally:
        proc.join(DEADLINE_S)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    table.notes += [
        "owner: a spawned process (agent file-owner: UCX + POSIX, progress thread) that "
        f"registered the file (FILE_SEG, by fd) and a {format_size(nbytes)} DRAM buffer; "
        "reader: agents in this process that loaded its metadata; UCX on loopback",
        "NIXL's answer: the call's result, or its exception and the line NIXL logged "
        "(`file:line] message`)",
    ]
    return table, remote_ok


# ---- 3. local read speed --------------------------------------------------------------------


@dataclass
class Side:
    """One way of reading every record; its rounds (wall, CPU, latencies per transfer)."""

    path: str
    mode: str
    per: int
    run: Callable[[list[int]], list[float]]
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    lat: list[list[float]] = field(default_factory=list)

    def best(self) -> int:
        return min(range(len(self.wall)), key=self.wall.__getitem__)


class Reads:
    """One record size: a file of ``n`` records, a registered DRAM region of as many slots,
    and the ways of reading one into the other."""

    def __init__(self, b: Any, agents: dict[str, Any], root: Path, size: int, n: int,
                 data: bytes) -> None:  # fmt: skip
        self.b, self.size, self.n, self.data = b, size, n, data
        self.path = root / f"records-{size}.bin"
        write_file(self.path, data)
        self.fd, self.direct = open_direct(self.path, os.O_RDONLY)
        self.region = mmap.mmap(-1, n * size)
        self.base = addr_of(self.region)
        view = memoryview(self.region)
        self.views = [view[i * size : (i + 1) * size] for i in range(n)]
        self.pool = ThreadPoolExecutor(BATCH, "nixl-file-preadv")
        self.agents = agents
        for agent in agents.values():
            agent.registerMem(self.reg_dlists()[0])
            agent.registerMem(self.reg_dlists()[1])

    def reg_dlists(self) -> tuple[Any, Any]:
        b, total = self.b, self.n * self.size
        return (b.nixlRegDList(b.DRAM_SEG, [(self.base, total, 0, "")]),
                b.nixlRegDList(b.FILE_SEG, [(0, total, self.fd, "")]))  # fmt: skip

    def close(self) -> None:
        for agent in self.agents.values():
            for dl in self.reg_dlists():
                with contextlib.suppress(Exception):
                    agent.deregisterMem(dl)
        self.pool.shutdown(wait=True)
        for v in self.views:
            v.release()
        self.region.close()
        os.close(self.fd)

    def sides(self) -> list[Side]:
        out = [Side("os.preadv", "1 thread", 1, self.preadv_one),
               Side("os.preadv", f"{BATCH} threads", BATCH, self.preadv_batch)]  # fmt: skip
        for mode in self.agents:
            for per in (1, BATCH):
                out.append(Side("NIXL POSIX", f"{mode}, spin-poll", per, self.nixl(mode, per)))
            if mode == DEFAULT_MODE:
                for per in (1, BATCH):
                    run = self.nixl(mode, per, SLEEP_POLL_S)
                    out.append(Side("NIXL POSIX", f"{mode}, poll every 100 µs", per, run))
        return out

    def preadv_one(self, order: list[int]) -> list[float]:
        lat, size, fd = [], self.size, self.fd
        for r in order:
            t0 = time.perf_counter()
            if os.preadv(fd, [self.views[r]], r * size) != size:
                raise BenchError("short read")
            lat.append(time.perf_counter() - t0)
        return lat

    def preadv_batch(self, order: list[int]) -> list[float]:
        lat, size, fd = [], self.size, self.fd
        for i in range(0, len(order), BATCH):
            t0 = time.perf_counter()
            futures = [self.pool.submit(os.preadv, fd, [self.views[r]], r * size)
                       for r in order[i : i + BATCH]]  # fmt: skip
            if any(f.result(timeout=DEADLINE_S) != size for f in futures):
                raise BenchError("short read")
            lat.append(time.perf_counter() - t0)
        return lat

    def nixl(self, mode: str, per: int, sleep_s: float = 0.0) -> Callable[[list[int]], list[float]]:
        """NIXL READs of ``per`` records each by the agent of ``mode`` (named by it)."""
        b, size, fd, base = self.b, self.size, self.fd, self.base
        agent, peer = self.agents[mode], agent_name(mode)

        def run(order: list[int]) -> list[float]:
            lat = []
            for i in range(0, len(order), per):
                t0 = time.perf_counter()
                pairs = [(r * size, base + r * size) for r in order[i : i + per]]
                status = read_file_seg(b, agent, peer, pairs, size, fd, sleep_s)
                lat.append(time.perf_counter() - t0)
                if status != b.NIXL_SUCCESS:
                    raise BenchError(f"NIXL READ from FILE_SEG: {status}")
            return lat

        return run

    def one_round(self, side: Side, order: list[int], keep: bool) -> None:
        ctypes.memset(self.base, 0x5A, self.n * self.size)
        c0, t0 = time.process_time(), time.perf_counter()
        lat = side.run(order)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if self.region[:] != self.data:
            raise BenchError(f"{side.path} {side.mode} x{side.per}: bytes differ from the file")
        if keep:
            side.wall.append(wall)
            side.cpu.append(cpu)
            side.lat.append(lat)


def measure(b: Any, agents: dict[str, Any], root: Path, size: int, args: argparse.Namespace,
            tick: Callable[[], None]) -> tuple[list[Side], Reads]:  # fmt: skip
    n = max(1, args.total_bytes // size)
    reads = Reads(b, agents, root, size, n, os.urandom(n * size))
    order = list(range(n))
    random.Random(args.seed).shuffle(order)
    sides = reads.sides()
    for r in range(args.rounds + 1):  # round 0: warm-up, not kept
        k = r % len(sides)
        for side in sides[k:] + sides[:k]:
            reads.one_round(side, order, keep=r > 0)
        tick()
    return sides, reads


def speed_table(results: list[tuple[int, int, bool, list[Side]]], args: argparse.Namespace,
                where: str) -> Table:  # fmt: skip
    table = Table(
        f"Local read of {format_size(args.total_bytes)} of records per size into registered "
        "DRAM, random order",
        ["record", "records", "path", "how", "records per transfer", "GB/s", "÷ preadv",
         "CPU s/GB", "p50 ms per transfer", "p99 ms per transfer", "rounds spread"],
    )  # fmt: skip
    for size, n, _, sides in results:
        nbytes = n * size
        ref = nbytes / sides[0].wall[sides[0].best()] / 1e9
        for s in sides:
            i = s.best()
            gbps = nbytes / s.wall[i] / 1e9
            table.add(format_size(size), n, s.path, s.mode, s.per, f"{gbps:.2f}",
                      f"{gbps / ref:.2f}", f"{s.cpu[i] / (nbytes / 1e9):.3f}",
                      f"{percentile(s.lat[i], 50) * 1e3:.2f}",
                      f"{percentile(s.lat[i], 99) * 1e3:.2f}",
                      f"{max(s.wall) / min(s.wall):.2f}")  # fmt: skip
    direct = sorted({"O_DIRECT" if d else "buffered (O_DIRECT refused)" for *_, d, _ in results})
    table.notes += [
        f"in {where}, one file per size read through one fd ({', '.join(direct)}), shared "
        "by every side; each record lands in its own slot of one page-aligned mmap "
        "registered with every NIXL agent as DRAM_SEG (preadv writes the same slots)",
        f"best of {args.rounds} rounds per side (after a warm-up round), sides alternating "
        "and rotating which goes first; every round's bytes compared with the file's; "
        "÷ preadv: against os.preadv on 1 thread, one record per call; rounds spread: the "
        "side's slowest round ÷ its fastest (the disk's noise)",
        "per transfer: the wall time of one preadv call, one batch of 8 preadv calls on 8 "
        "threads, or one NIXL transfer (descriptor lists built, createXferReq, postXferReq, "
        "getXferStatus to completion, releaseXferReq); spin-poll: getXferStatus in a loop "
        "(a core busy while it waits: CPU s/GB counts it); poll every 100 µs: a sleep "
        "between polls",
    ]
    return table


def conclusion(results: list[tuple[int, int, bool, list[Side]]], remote_ok: bool) -> Table:
    """Per size: preadv beside NIXL's default mode (spinning, then polling every 100 µs)
    and NIXL's fastest row; the finding and the recommendation in its notes."""
    table = Table("Conclusion", ["record", "preadv GB/s", "preadv CPU s/GB",
                                 f"preadv x{BATCH} threads GB/s",
                                 f"NIXL {DEFAULT_MODE} spin x1 GB/s", "its CPU s/GB",
                                 f"NIXL {DEFAULT_MODE} 100 µs x1 GB/s", "its CPU s/GB",
                                 "fastest NIXL row", "its GB/s", "its CPU s/GB"])  # fmt: skip
    spin, slept, fastest, batched = [], [], [], []  # (GB/s ratio, CPU ratio) against preadv
    for size, n, _, sides in results:
        nbytes = n * size

        def gb(s: Side, nbytes: int = nbytes) -> float:
            return nbytes / s.wall[s.best()] / 1e9

        def cpu(s: Side, nbytes: int = nbytes) -> float:
            return s.cpu[s.best()] / (nbytes / 1e9)

        pre, pre8 = sides[0], sides[1]
        nixl = [s for s in sides if s.path.startswith("NIXL")]
        one = [s for s in nixl if s.per == 1 and s.mode.startswith(DEFAULT_MODE + ",")]
        if len(one) < 2:
            continue
        best = max(nixl, key=gb)
        for out, s in ((spin, one[0]), (slept, one[1]), (fastest, best)):
            out.append((gb(s) / gb(pre), cpu(s) / cpu(pre)))
        best8 = max((s for s in nixl if s.per == BATCH), key=gb)
        batched.append((gb(best8) / gb(pre8), cpu(best8) / cpu(pre8)))
        table.add(format_size(size), f"{gb(pre):.2f}", f"{cpu(pre):.3f}", f"{gb(pre8):.2f}",
                  f"{gb(one[0]):.2f}",
                  f"{cpu(one[0]):.3f}", f"{gb(one[1]):.2f}", f"{cpu(one[1]):.3f}",
                  f"{best.mode} x{best.per}", f"{gb(best):.2f}", f"{cpu(best):.3f}")  # fmt: skip

    def span(pairs: list[tuple[float, float]], k: int) -> str:
        lo, hi = min(p[k] for p in pairs), max(p[k] for p in pairs)
        return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f} to {hi:.2f}x"

    if remote_ok:
        table.notes.append("a remote agent DID read the owner's FILE_SEG: see the table above")
    else:
        table.notes.append(
            "a remote agent cannot read a FILE_SEG (NIXL: no potential backend found): UCX, "
            "the only remote backend, takes DRAM and VRAM, and the file backends are "
            "local-only; a ucx:// reader of a disk block needs it in registered memory on "
            "the node whichever way the node reads it there: the choice is only how the "
            "node stages it")  # fmt: skip
    if spin:
        table.notes.append(
            f"one record per transfer, NIXL POSIX ({DEFAULT_MODE}) reads at {span(spin, 0)} "
            f"os.preadv's GB/s for {span(spin, 1)} its CPU per GB when it spins, and at "
            f"{span(slept, 0)} for {span(slept, 1)} the CPU when it polls every 100 µs; its "
            f"fastest row of all (any mode, up to {BATCH} records per transfer) reads at "
            f"{span(fastest, 0)} os.preadv's GB/s for {span(fastest, 1)} its CPU; its "
            f"fastest {BATCH}-record transfers, against {BATCH} preadv calls at once on "
            f"{BATCH} threads: {span(batched, 0)} the GB/s for {span(batched, 1)} the CPU"
        )
        faster = max(p[0] for p in spin + slept) >= FASTER
        table.notes.append(
            "recommendation: stage with os.preadv (O_DIRECT) into the lease's registered "
            "slot, as the store does. A NIXL file backend gives the ucx:// reader no direct "
            "path (it still READs registered DRAM); locally "
            + (f"it reads single records faster here ({span(spin, 0)} spinning), but for "
               if faster else
               f"it is no faster beyond the disk's noise (one record per transfer: "
               f"{span(spin, 0)} when it spins, which is what a poller that never sleeps "
               f"buys, {span(slept, 0)} when it polls every 100 µs; {BATCH} per transfer: "
               f"{span(batched, 0)} preadv on {BATCH} threads), for ")
            + f"{span(spin, 1)} the CPU per GB spinning or {span(slept, 1)} polling, and a "
            "staging path through it must register every segment file and poll each "
            "transfer to completion, where preadv blocks in the kernel")  # fmt: skip
    return table


# ---- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=".", help="where the files go (a temp dir in it)")
    p.add_argument("--total", default="128MiB", help="bytes of records per size")
    p.add_argument("--sizes", default="4 MiB,1 MiB", help="record sizes")
    p.add_argument("--rounds", type=int, default=3, help="rounds kept per side (best shown)")
    p.add_argument("--seed", type=int, default=0, help="of the read order")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.total_bytes = parse_size(args.total)
    if any(s % ALIGN for s in sizes) or args.rounds < 1:
        p.error(f"sizes must be multiples of {ALIGN} bytes, rounds at least 1")
    b = import_bindings()
    results: list[tuple[int, int, bool, list[Side]]] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-nixl-file-", dir=args.dir) as d:
        root = Path(d)
        plugins = plugins_table(b)
        modes, agents = modes_table(b, root)
        remote, remote_ok = remote_table(b, root)
        with progress() as bar:
            task = bar.add_task("read rounds", total=len(sizes) * (args.rounds + 1))
            for size in sizes:
                sides, reads = measure(b, agents, root, size, args, lambda: bar.advance(task))
                results.append((size, reads.n, reads.direct, sides))
                reads.close()
                reads.path.unlink()
    speed = speed_table(results, args, os.path.abspath(args.dir))
    print_report("Staging a disk block: os.preadv vs NIXL's file backends", "bench/nixl_file.py",
                 argv, [plugins, modes, remote, speed, conclusion(results, remote_ok)])  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared pieces of the benchmarks in ``bench/``.

- Report: :func:`machine_markdown` (CPU, cores, torch, commit), :class:`Table` (Markdown),
  :func:`print_report` (title, command, machine, tables), :func:`progress` (rich, on
  stderr), :func:`save_bar_plot` (optional PNG).
- Measure: :func:`meter` (wall time, CPU and page faults of this and another process),
  :func:`time_calls` / :func:`time_calls_async` / :func:`latency_stats` (p50, p99, mean),
  :func:`best_of` (the fastest of a few calls),
  :func:`in_flight` (calls kept in flight, each timed),
  :func:`proc_stat`, :func:`thread_cpu`, :func:`window_cpu` (idle CPU by thread),
  :func:`percentile`.
- Processes: :class:`Serve` (a ``kvstore serve`` on port 0), :class:`SpawnedServer`
  (a baseline server in a spawned process) and :func:`spawn_worker` (a one-process pool).
- Data plane: :class:`KeptConnection` (a ``NodeClient``'s connections: one kept connection,
  so that a benchmark lane's exchanges all run on the connection it dialled).
- Baseline: raw asyncio sockets (:func:`serve_raw_sockets`, :func:`raw_socket_put`,
  :func:`raw_socket_get`): a 9-byte header, the bytes straight into preallocated memory, an
  ack per put — what a transport over plain TCP sockets could reach at best.

Benchmarks print their Markdown on stdout (so ``python bench/x.py > out.md`` is clean) and
their progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing as mp
import os
import platform
import re
import resource
import selectors
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = [
    "DISK_COUNTERS",
    "BarPanel",
    "BenchError",
    "KeptConnection",
    "ProcStat",
    "Serve",
    "SpawnedServer",
    "Table",
    "WindowCpu",
    "expect",
    "explain",
    "in_flight",
    "latency_stats",
    "machine_info",
    "machine_markdown",
    "meter",
    "open_direct",
    "percentile",
    "print_report",
    "proc_stat",
    "progress",
    "raw_socket_connect",
    "raw_socket_get",
    "raw_socket_put",
    "save_bar_plot",
    "seeded_kv",
    "seeded_tokens",
    "serve_raw_sockets",
    "spawn_worker",
    "start_pool",
    "thread_cpu",
    "time_calls",
    "time_calls_async",
    "window_cpu",
]

DISK_COUNTERS = (
    "written",
    "read",
    "staged_cold",
    "staged_warm",
    "unwritten_evictions",
    "skipped",
    "errors",
)
"""The disk tier's counters in a node's stats (its ``tiers`` entry named ``disk``) that
the disk benchmarks report."""

if TYPE_CHECKING:
    import torch

    from kvstore.transport.base import Connection

_REPO = Path(__file__).resolve().parent.parent


class BenchError(RuntimeError):
    """A measurement could not be taken (a miss, a refused chunk, a process that failed)."""


def seeded_tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids drawn from ``seed`` (the same prompt in every process)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 150_000, (n,), generator=g).tolist()


def seeded_kv(seed: int, layer: int, tokens: int, heads: int, head_dim: int) -> Any:
    """The KV of ``(seed, layer)`` drawn from them: ``[2, tokens, heads, head_dim]`` bf16
    (what a writer puts and a checker compares, bit for bit, in another process)."""
    import torch

    g = torch.Generator().manual_seed(seed * 16 + layer)
    return torch.randn(2, tokens, heads, head_dim, generator=g).bfloat16()


def expect(ok: bool, what: str) -> None:
    """Raise :class:`BenchError` with ``what`` unless ``ok``."""
    if not ok:
        raise BenchError(what)


@dataclass
class Table:
    """One Markdown table with a title and notes printed under it."""

    title: str
    headers: Sequence[str]
    rows: list[Sequence[object]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        """Append one row (cells are formatted with ``str``)."""
        if len(cells) != len(self.headers):
            raise ValueError(f"row has {len(cells)} cells, table has {len(self.headers)}")
        self.rows.append(cells)

    def to_markdown(self) -> str:
        """The title as a level-3 heading, the table (numbers right-aligned), the notes."""
        first = self.rows[0] if self.rows else [""] * len(self.headers)
        align = ["---:" if isinstance(c, int | float) or _numeric(c) else "---" for c in first]
        lines = [f"### {self.title}", ""]
        lines.append("| " + " | ".join(str(h) for h in self.headers) + " |")
        lines.append("|" + "|".join(align) + "|")
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in self.rows]
        if self.notes:
            lines.append("")
            lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _numeric(cell: object) -> bool:
    text = str(cell).replace(",", "").replace("x", "").replace("%", "").strip()
    try:
        float(text)
    except ValueError:
        return False
    return True


def machine_info() -> dict[str, str]:
    """CPU model, cores, memory, OS, Python, torch and commit of this machine and tree.

    Reads ``/proc`` and runs ``git rev-parse`` (read only); fields that cannot be read say
    ``unknown``. Imports torch.
    """
    import torch

    info = {
        "cpu": _cpuinfo_field("model name"),
        "cores": f"{os.cpu_count()} logical, {len(os.sched_getaffinity(0))} usable",
        "memory": _meminfo_total(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": f"{torch.__version__} ({torch.get_num_threads()} intra-op threads)",
        "commit": _git_commit(),
    }
    return info


def machine_markdown() -> str:
    """:func:`machine_info` as one Markdown bullet line per field."""
    return "\n".join(f"- **{k}**: {v}" for k, v in machine_info().items()) + "\n"


def print_report(title: str, script: str, argv: list[str] | None, tables: Iterable[Table]) -> None:
    """Print a benchmark's Markdown: ``## title``, the command that ran it (``argv``, or
    this process's arguments), the machine, then each table."""
    command = " ".join([f"python {script}", *(argv if argv is not None else sys.argv[1:])])
    print(f"## {title}\n\n`{command}`\n")
    print(machine_markdown())
    for table in tables:
        print(table.to_markdown())


def _cpuinfo_field(name: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _meminfo_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return "unknown"


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(_REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip()


@dataclass
class Serve:
    """A ``kvstore serve`` subprocess (loopback, every port 0) and its ready-line addresses
    (``grpc``, ``data``, ``node``, ``metrics``). Start with :meth:`start`; always
    :meth:`stop` (also a context manager)."""

    proc: subprocess.Popen[str]
    addresses: dict[str, str]
    stderr: IO[str]

    @classmethod
    def start(
        cls,
        *flags: str,
        timeout: float = 60.0,
        command: str = "serve",
        prefix: Sequence[str] = (),
        mapped: bool = False,
    ) -> Serve:
        """Run ``python -m kvstore.cli serve --grpc-port 0 --data-port 0 --metrics-port 0
        FLAGS`` and wait up to ``timeout`` s for its ``kvstore ready`` line. Raises
        ``RuntimeError`` (with the tail of its stderr) when it exits or stays silent.
        ``command`` ``master`` or ``node``: that command with FLAGS alone (no ports added);
        ``prefix``: what runs it (``ip netns exec NS``). ``mapped``: then also wait (up to
        ``timeout`` s more) until its node has mapped its host memory (:meth:`wait_mapped`),
        so that no measured put pays the first touch of a page."""
        ports = ["--grpc-port", "0", "--data-port", "0", "--metrics-port", "0"]
        ports = ports if command == "serve" else []
        # Kept open for the life of the process (read on failure, closed by stop()).
        err = tempfile.TemporaryFile("w+")  # noqa: SIM115
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kvstore.cli", command, *ports, *flags],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        serve = cls(proc, {}, err)
        line = serve._ready_line(timeout)
        if line is None:
            tail = serve.stderr_tail()  # (stop() closes the file)
            serve.stop()
            raise RuntimeError(f"kvstore {command} did not become ready: {tail}")
        serve.addresses = dict(re.findall(r"(\w+)=(\S+)", line))
        if mapped:
            try:
                serve.wait_mapped(timeout)
            except BaseException:
                serve.stop()
                raise
        return serve

    def wait_mapped(self, timeout: float = 60.0) -> str:
        """Wait until the node's stats no longer say ``host_mapping: mapping`` (its start-up
        mapping of host memory ended); the state it says then (``mapped`` or ``off``).
        Blocks the caller, even on an event loop's thread (asked on a thread of its own
        there, as :meth:`start` blocks for the ready line). Raises ``RuntimeError`` past
        ``timeout`` s."""

        async def ask() -> str:
            from kvstore.dataplane import NodeClient

            stats = await NodeClient(self.addresses["data"], timeout_s=5).stats()
            return str(stats.get("host_mapping", "off"))

        def state() -> str:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return asyncio.run(ask())
            with ThreadPoolExecutor(1) as thread:
                return thread.submit(lambda: asyncio.run(ask())).result()

        deadline = time.monotonic() + timeout
        while (now := state()) == "mapping":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node did not map its host memory within {timeout} s")
            time.sleep(0.1)
        return now

    def _ready_line(self, timeout: float) -> str | None:
        out = self.proc.stdout
        if out is None:
            return None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(out, selectors.EVENT_READ)
            while sel.select(max(0.0, deadline - time.monotonic())):
                line = out.readline()
                if not line:
                    return None
                if "kvstore ready" in line:
                    return line
        return None

    def stderr_tail(self, nbytes: int = 2000) -> str:
        """The last ``nbytes`` characters the server wrote on stderr."""
        if self.stderr.closed:
            return ""
        self.stderr.seek(0)
        return self.stderr.read()[-nbytes:]

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait ``timeout`` s (then SIGKILL); return the exit status. Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate(timeout=5)
        if self.proc.returncode != 0:
            sys.stderr.write(f"kvstore serve exited with {self.proc.returncode}: "
                             f"{self.stderr_tail()}\n")  # fmt: skip
        self.stderr.close()
        return self.proc.returncode

    def __enter__(self) -> Serve:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_pool(
    stack: contextlib.ExitStack,
    *flags: str,
    apart: bool,
    prefix: Sequence[str] = (),
    mapped: bool = False,
) -> tuple[Serve, Serve | None]:
    """``kvstore serve FLAGS``, or with ``apart`` a ``kvstore master`` and a ``kvstore node
    FLAGS``, each a process of its own, as a cluster runs them (every put's commit then
    crosses gRPC); each entered on ``stack``. Returns the node and the master (None: in the
    node's process); the node's ``grpc`` address is the master's either way. ``prefix`` and
    ``mapped`` as for :meth:`Serve.start` (``mapped``: the node's)."""
    if not apart:
        return stack.enter_context(Serve.start(*flags, prefix=prefix, mapped=mapped)), None
    master = stack.enter_context(
        Serve.start("--grpc-port", "0", "--metrics-port", "0", command="master", prefix=prefix)
    )
    node = stack.enter_context(Serve.start(
        "--master", master.addresses["grpc"], "--data-port", "0", "--metrics-port", "0",
        *flags, command="node", prefix=prefix, mapped=mapped))  # fmt: skip
    node.addresses["grpc"] = master.addresses["grpc"]
    return node, master


@dataclass(frozen=True)
class ProcStat:
    """CPU seconds (user + system, all threads) and minor page faults of one process; and,
    where the kernel keeps them (``/proc/<pid>/task/<tid>/schedstat``), each live thread's
    time on a CPU in nanoseconds, which a difference of two readings uses."""

    cpu_s: float
    minor_faults: int
    thread_ns: dict[int, int] = field(default_factory=dict, compare=False)

    def __sub__(self, other: ProcStat) -> ProcStat:
        """The window between ``other`` and this reading. Its CPU is the threads' own
        nanoseconds where both readings have them (a thread started in the window counts
        from 0), plus what the clock ticks say beyond that by more than two ticks: time of
        threads that ended in the window, which only the process's ticks keep. Without
        schedstat: the ticks alone (10 ms each, usually)."""
        faults = self.minor_faults - other.minor_faults
        ticks = self.cpu_s - other.cpu_s
        if not self.thread_ns or not other.thread_ns:
            return ProcStat(ticks, faults)
        ns = sum(t - other.thread_ns.get(tid, 0) for tid, t in self.thread_ns.items())
        precise = max(0, ns) / 1e9
        gone = max(0.0, ticks - precise - 2 / _CLK_TCK)
        return ProcStat(precise + gone, faults)


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _schedstat_ns(pid: int, tids: list[int]) -> dict[int, int]:
    """Nanoseconds on a CPU of each of ``tids`` of ``pid`` that is still alive (empty where
    the kernel keeps no schedstat)."""
    out: dict[int, int] = {}
    for tid in tids:
        try:
            raw = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text()
        except OSError:
            continue
        out[tid] = int(raw.split()[0])
    return out


def proc_stat(pid: int, tid: int | None = None) -> ProcStat:
    """Read ``/proc/<pid>/stat`` (utime + stime, minflt), or with ``tid`` that thread's
    (``/proc/<pid>/task/<tid>/stat``), and the schedstat nanoseconds of every thread (of
    ``tid`` alone); a difference of two readings is then precise to the microsecond, not to
    a clock tick (see :meth:`ProcStat.__sub__`). Never blocks. Raises ``OSError`` when the
    process (or the thread) is gone."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    raw = Path(path).read_text()
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) ": state is fields[0]
    minflt, utime, stime = int(fields[7]), int(fields[11]), int(fields[12])
    tids = [tid] if tid is not None else [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    return ProcStat((utime + stime) / _CLK_TCK, minflt, _schedstat_ns(pid, tids))


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (utime + stime) of every thread of process ``pid``, by thread id, with the
    thread's name (``comm``). Never blocks; one clock tick of resolution. Threads that exit
    while it reads are left out; raises ``OSError`` when the process is gone."""
    out: dict[int, tuple[str, float]] = {}
    for entry in os.listdir(f"/proc/{pid}/task"):
        try:
            raw = Path(f"/proc/{pid}/task/{entry}/stat").read_text()
        except OSError:
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2 :].split()
        out[int(entry)] = (name, (int(fields[11]) + int(fields[12])) / _CLK_TCK)
    return out


@dataclass(frozen=True)
class WindowCpu:
    """What one process used over a wall-clock window: cores, and the busiest threads by
    name (``comm``; threads of one name summed), each in cores, busiest first."""

    seconds: float
    cores: float
    threads: list[tuple[str, float]]


def window_cpu(pid: int, seconds: float, top: int = 4) -> WindowCpu:
    """Sleep ``seconds`` (blocks) and report the CPU process ``pid`` used meanwhile, with
    its ``top`` busiest thread names. Raises ``OSError`` when the process is gone."""
    t0, s0, start = thread_cpu(pid), proc_stat(pid).cpu_s, time.perf_counter()
    time.sleep(seconds)
    t1, s1, wall = thread_cpu(pid), proc_stat(pid).cpu_s, time.perf_counter() - start
    per: dict[str, float] = {}
    for tid, (name, cpu) in t1.items():
        per[name] = per.get(name, 0.0) + cpu - t0.get(tid, (name, 0.0))[1]
    busiest = sorted(((n, c / wall) for n, c in per.items() if c > 0), key=lambda x: -x[1])
    return WindowCpu(wall, (s1 - s0) / wall, busiest[:top])


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation.

    Raises ``ValueError`` for an empty sequence or ``q`` outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must lie in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


@contextlib.contextmanager
def meter(pid: int) -> Iterator[dict[str, float]]:
    """Measure the ``with`` body: ``s`` (wall seconds), ``server_cpu`` / ``server_faults``
    (CPU seconds and minor faults of process ``pid``, e.g. a server), ``server_main_cpu``
    (the CPU seconds of its main thread alone: a kvstore server's event loop) and
    ``client_cpu`` / ``client_faults`` (the same for this process, every thread). The
    yielded dict is filled when the body exits. Raises ``OSError`` when ``pid`` is gone."""
    rec: dict[str, float] = {}
    s0, m0, c0 = proc_stat(pid), proc_stat(pid, pid), resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    yield rec
    t1 = time.perf_counter()
    s1, m1, c1 = proc_stat(pid), proc_stat(pid, pid), resource.getrusage(resource.RUSAGE_SELF)
    rec["s"] = t1 - t0
    rec["server_cpu"] = (s1 - s0).cpu_s
    # The main thread's time from the same two readings as the whole's where schedstat has
    # it (its own readings come a moment later: a part could then exceed its whole).
    both = pid in s0.thread_ns and pid in s1.thread_ns
    main = (s1.thread_ns[pid] - s0.thread_ns[pid]) / 1e9 if both else (m1 - m0).cpu_s
    rec["server_main_cpu"] = min(main, rec["server_cpu"])
    rec["server_faults"] = (s1 - s0).minor_faults
    rec["client_cpu"] = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    rec["client_faults"] = c1.ru_minflt - c0.ru_minflt


def latency_stats(samples: Sequence[float]) -> dict[str, float]:
    """``p50``, ``p99`` and ``mean`` of ``samples`` (seconds in, seconds out)."""
    return {
        "p50": percentile(samples, 50),
        "p99": percentile(samples, 99),
        "mean": statistics.fmean(samples),
    }


def best_of(fn: Callable[[], object], reps: int) -> float:
    """Seconds of the fastest of ``reps`` calls of ``fn``, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def time_calls(fn: Callable[[], object], n: int, warmup: int = 50) -> dict[str, float]:
    """Call ``fn`` ``warmup`` times, then time ``n`` sequential calls: :func:`latency_stats`."""
    for _ in range(warmup):
        fn()
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return latency_stats(lat)


async def time_calls_async(
    call: Callable[[], Awaitable[object]], n: int, warmup: int = 50
) -> dict[str, float]:
    """Like :func:`time_calls` for a coroutine function, awaited one call at a time; also
    ``cpu``: this process's CPU (every thread) per call, on average."""
    for _ in range(warmup):
        await call()
    lat = []
    cpu0 = time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        lat.append(time.perf_counter() - t0)
    return {**latency_stats(lat), "cpu": (time.process_time() - cpu0) / n}


T = TypeVar("T")


async def in_flight(
    call: Callable[[int, int], Awaitable[T]], indices: Sequence[int], depth: int
) -> list[tuple[float, T]]:
    """Await ``call(i, lane)`` for every ``i`` of ``indices`` with up to ``depth`` calls in
    flight: ``depth`` lanes (coroutines), each taking the next index as its last call ends;
    ``lane`` (0 .. depth - 1) names the lane, e.g. to give each a connection of its own.
    Returns ``(seconds, result)`` of every call, in completion order. The first exception
    cancels the other lanes and propagates, wrapped in an ``ExceptionGroup``."""
    todo, out = iter(indices), []

    async def lane(k: int) -> None:
        for i in todo:  # shared: whichever lane is free takes the next index
            t0 = time.perf_counter()
            result = await call(i, k)
            out.append((time.perf_counter() - t0, result))

    async with asyncio.TaskGroup() as group:
        for k in range(depth):
            group.create_task(lane(k))
    return out


class KeptConnection:
    """``kvstore.dataplane.Connections`` of one benchmark lane: every exchange of the
    ``NodeClient`` runs on ``conn``, dialled beforehand and kept (no pool, no dial, no
    liveness check inside the timing). An exchange that raises closes it, as a pool would:
    its byte stream may be unframed; the lane then fails its next exchange."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    @contextlib.asynccontextmanager
    async def use(self, uri: str, timeout: float) -> AsyncIterator[Connection]:
        """``conn``, whatever ``uri`` and ``timeout`` (it is dialled already)."""
        try:
            yield self.conn
        except BaseException:
            await self.conn.close()
            raise


@dataclass
class SpawnedServer:
    """A helper server in a process of its own (``spawn`` start method) and the address it
    reported. Start with :meth:`start`; always :meth:`stop`."""

    proc: mp.process.BaseProcess
    address: Any

    @classmethod
    def start(cls, target: Callable[[Pipe], None], timeout: float = 60.0) -> SpawnedServer:
        """Spawn ``target(pipe)`` — a module-level function that binds, sends its address
        through ``pipe`` and serves until terminated — and wait up to ``timeout`` s for
        that address. Raises ``RuntimeError`` when none comes."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(child,), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(timeout):
            proc.kill()
            proc.join(5)
            name = getattr(target, "__name__", None) or getattr(target, "func", target)
            raise RuntimeError(f"{getattr(name, '__name__', name)} did not report an address")
        return cls(proc, parent.recv())

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.proc.pid or 0

    def stop(self) -> None:
        """SIGTERM, reap (SIGKILL after 10 s). Idempotent."""
        self.proc.terminate()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def spawn_worker(
    stack: contextlib.ExitStack, close_job: Callable[[], object] | None = None
) -> ProcessPoolExecutor:
    """A one-process pool (``spawn``) whose jobs run one after another in the same process,
    so module-level state (event loop, connections) persists across jobs. On ``stack``
    exit, ``close_job`` (a module-level function) runs in it first, then it is shut down."""
    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))

    def close() -> None:
        if close_job is not None:
            with contextlib.suppress(Exception):
                pool.submit(close_job).result(30)
        pool.shutdown(wait=True, cancel_futures=True)

    stack.callback(close)
    return pool


def progress() -> Progress:
    """A rich progress bar on stderr (so stdout stays clean Markdown); use as a context
    manager: ``with progress() as p: task = p.add_task("…", total=n); p.advance(task)``."""
    return Progress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )


@dataclass
class BarPanel:
    """One subplot: a bar per label, optionally several series side by side."""

    title: str
    ylabel: str
    labels: list[str]
    series: dict[str, list[float]]


def save_bar_plot(
    path: str | Path, panels: Sequence[BarPanel], suptitle: str = "", columns: int | None = None
) -> None:
    """Write ``panels`` side by side (or in rows of ``columns``) as a PNG at ``path``
    (matplotlib, Agg backend).

    Imports matplotlib on first use; raises ``ImportError`` when it is not installed and
    ``OSError`` when ``path`` cannot be written. Blocks for about a second.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(columns or len(panels), len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.8 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        n = len(panel.series)
        width = 0.8 / max(n, 1)
        for k, (name, values) in enumerate(panel.series.items()):
            xs = [i + (k - (n - 1) / 2) * width for i in range(len(panel.labels))]
            bars = ax.bar(xs, values, width, label=name)
            ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.set_xticks(range(len(panel.labels)), panel.labels, rotation=25, ha="right", fontsize=8)
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.ylabel)
        if n > 1:
            ax.legend(fontsize=8)
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- raw asyncio sockets: a header, the bytes, an ack; nothing else

RAW_HEAD = struct.Struct("<cII")
"""Raw socket exchange header: op (b"P" put, b"G" get), chunk count, chunk bytes."""


def raw_socket_connect(addr: tuple[str, int], timeout: float) -> socket.socket:
    """A connected, non-blocking TCP_NODELAY socket to a :func:`serve_raw_sockets` server
    (blocks up to ``timeout`` s to connect; raises ``OSError``)."""
    sock = socket.create_connection(addr, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


async def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    loop = asyncio.get_running_loop()
    while view:
        n = await loop.sock_recv_into(sock, view)
        if n == 0:
            raise ConnectionResetError("raw socket closed")
        view = view[n:]


async def raw_socket_put(sock: socket.socket, chunks: Sequence[memoryview]) -> None:
    """Send a ``(P, count, size)`` header and the equal-sized ``chunks``; await the 1-byte
    ack. Raises ``OSError`` (``ConnectionResetError`` when the server closed)."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, RAW_HEAD.pack(b"P", len(chunks), len(chunks[0])))
    for chunk in chunks:
        await loop.sock_sendall(sock, chunk)
    await _recv_exactly(sock, memoryview(bytearray(1)))


async def raw_socket_get(sock: socket.socket, chunks: Sequence[memoryview]) -> None:
    """Send a ``(G, count, size)`` header; receive straight into the equal-sized writable
    ``chunks``. Raises like :func:`raw_socket_put`."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, RAW_HEAD.pack(b"G", len(chunks), len(chunks[0])))
    for chunk in chunks:
        await _recv_exactly(sock, chunk)


def serve_raw_sockets(pipe: Pipe, region_bytes: int = 256 * 2**20) -> None:
    """Process target (:class:`SpawnedServer`): a plain asyncio socket server on loopback
    that receives into (``sock_recv_into``) and sends from (``sock_sendall``) successive
    slices of ``region_bytes`` of preallocated, touched memory (a node's kind: huge pages
    where the kernel has them); an exchange may move at most ``region_bytes``. Sends
    ``(host, port)`` through ``pipe``; serves until terminated."""
    asyncio.run(_raw_server(pipe, region_bytes))


def node_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory as a node maps its own (``kvstore.core.arena.host_memory``:
    huge pages where the kernel has them), every page written: a raw target's memory, so a
    ratio to it measures kvstore's work and not the kind of memory it copies into."""
    import torch

    from kvstore.core.arena import host_memory

    t, _ = host_memory(nbytes)
    with torch.no_grad():
        t.fill_(1)
    return t


async def _raw_server(pipe: Pipe, region_bytes: int) -> None:
    loop = asyncio.get_running_loop()
    region = memoryview(node_memory(region_bytes).numpy())  # written: every page touched
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    pipe.send(listener.getsockname()[:2])
    tasks = set()
    while True:
        sock, _ = await loop.sock_accept(listener)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        tasks.add(task := asyncio.create_task(_raw_serve(sock, region)))
        task.add_done_callback(tasks.discard)


async def _raw_serve(sock: socket.socket, region: memoryview) -> None:
    loop, head = asyncio.get_running_loop(), memoryview(bytearray(RAW_HEAD.size))
    with sock, contextlib.suppress(ConnectionError):
        for turn in itertools.count():
            await _recv_exactly(sock, head)
            op, count, size = RAW_HEAD.unpack(head)
            total = count * size
            if not 0 < total <= len(region) or op not in (b"P", b"G"):
                return
            base = turn % (len(region) // total) * total
            for k in range(count):
                view = region[base + k * size : base + (k + 1) * size]
                await (loop.sock_sendall(sock, view) if op == b"G" else _recv_exactly(sock, view))
            if op == b"P":
                await loop.sock_sendall(sock, b"k")


def open_direct(path: str | Path, flags: int) -> tuple[int, bool]:
    """``path`` opened with ``O_DIRECT`` where the file system takes it, else buffered (tmpfs
    on older kernels); the fd and whether it is direct."""
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError:
        return os.open(path, flags, 0o600), False


def explain(parser: argparse.ArgumentParser, doc: str | None) -> argparse.ArgumentParser:
    """``parser``'s ``--help`` made to explain the script: its whole docstring ``doc``
    after the options (which it describes in prose), and each option's default where the
    option has no help of its own. Returns ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    head, _, rest = (doc or "").strip().partition("\n\n")
    parser.description = parser.description or head
    if rest and rest not in parser.description:  # (a description that is the whole doc)
        parser.epilog = rest
    for action in parser._actions:
        if action.help is None and action.default is not argparse.SUPPRESS:
            unset = action.default in (None, "")
            action.help = "default: unset" if unset else "default: %(default)s"
    return parser

"""The pool under faults: two masters on one Redis, four nodes, clients with ``replicas=2``
writing and reading deterministic KV and checking every byte, while a fault is injected on
a schedule.

    python bench/chaos.py [--duration 600] [--every 20] [--rounds 0] [--nodes 4]
                          [--writers 2] [--readers 2] [--lease-s 6] [--netns auto|on|off]
                          [--seed 1]
                          [--plot bench/chaos.png] [--json PATH]

Everything runs on this machine: a ``redis-server`` on a free loopback port, two
``kvstore master --redis`` processes, ``--nodes`` ``kvstore node`` processes (each told
both masters, in turn first, so heartbeats go to both) and the client tasks in this
process. With network namespaces (``--netns on``, or ``auto`` where ``ip netns`` is
permitted) every node runs in a namespace of its own behind a veth pair on one bridge
(10.x.y.0/24, nothing routed beyond it), so a node can be cut off (its link taken down)
or slowed (``tc tbf``); otherwise every process binds loopback and those faults are skipped
(the report says so).

Faults, in turn, every ``--every`` s, each held for half of that and then healed (a fault
waits for the previous one to heal: faults never overlap). With ``--rounds N`` the run ends
once every kind has been injected N times and healed, ``--duration`` then being its bound:
a slow restart on a loaded machine delays the schedule but never drops a kind from it.

- ``kill-node``: ``kill -9`` of a node, restarted (same id, same port, empty memory; it
  registers once its old registration's lease ended: the id is bound to it);
- ``stop-node``: SIGSTOP, then SIGCONT;
- ``kill-master``: ``kill -9`` of a master, restarted on its port;
- ``cut-node``: the node's link goes down: packets are dropped both ways, connections
  stall without a reset (netns only);
- ``slow-node``: the node's link is shaped to 20 Mbit/s each way (netns only; ``tc tbf``,
  since ``netem`` is not in every kernel).

Workload: each writer puts every layer of a new 512-token prompt (``quant="none"``, so a
read must return the very bytes written; 8 blocks of 64 tokens a layer) with
``replicas=2, min_replicas=1``; each reader takes one of the last 64 prompts written, calls
``match_prefix`` and reads one layer, and compares every returned byte with what was
written. A read that returns fewer tokens than were stored is a *short* read (both copies
lost: a cache miss, not an error); an exception is an *error*. Reported: operations by
kind and outcome, wrong bytes (must be 0: the exit status is 1 otherwise), errors by type,
availability per second (operations without an error ÷ operations), and per fault how long
errors went on after it was injected. Markdown on stdout, progress on stderr, a PNG
timeline with ``--plot``, every figure as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))

import torch

import kvclient
from bench._common import (
    Serve,
    Table,
    explain,
    percentile,
    print_report,
    progress,
    seeded_kv,
    seeded_tokens,
)
from kvstore.errors import KVStoreError

TOKENS, BLOCK, HEADS, HEAD_DIM, LAYERS = 512, 64, 4, 64, 2
NS = kvclient.Namespace(model="chaos", revision="1", num_layers=LAYERS, num_kv_heads=HEADS,
                        head_dim=HEAD_DIM, dtype=torch.bfloat16, block_tokens=BLOCK,
                        quant="none")  # fmt: skip
OP_TIMEOUT_S = 5.0
RECENT = 64
NET_FAULTS = ("cut-node", "slow-node")
FAULTS = ("kill-node", "stop-node", "kill-master", *NET_FAULTS)
SLOW_RATE = "20mbit"
"""A slowed node's link, each way (2.5 MB/s: a 256 KiB layer of a prompt takes ~0.1 s)."""


def kv_of(seed: int, layer: int) -> torch.Tensor:
    """The KV put for ``(seed, layer)``: ``[2, TOKENS, HEADS, HEAD_DIM]`` bf16."""
    return seeded_kv(seed, layer, TOKENS, HEADS, HEAD_DIM)


def tokens_of(seed: int) -> list[int]:
    return seeded_tokens(seed, TOKENS)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


# ---- the cluster ------------------------------------------------------------------------


@dataclass
class Net:
    """A bridge and one network namespace per node (``ip netns``, veth, ``tc netem``)."""

    tag: str
    subnet: str
    nodes: int
    made: list[str] = field(default_factory=list)

    @property
    def host_ip(self) -> str:
        return f"{self.subnet}.1"

    def node_ip(self, i: int) -> str:
        return f"{self.subnet}.{11 + i}"

    def ns(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def create(self) -> None:
        br = f"{self.tag}br"
        run("ip", "link", "add", br, "type", "bridge")
        self.made.append(f"link:{br}")
        run("ip", "addr", "add", f"{self.host_ip}/24", "dev", br)
        run("ip", "link", "set", br, "up")
        for i in range(self.nodes):
            ns, host_if, ns_if = self.ns(i), f"{self.tag}h{i}", f"{self.tag}c{i}"
            run("ip", "netns", "add", ns)
            self.made.append(f"netns:{ns}")
            run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
            self.made.append(f"link:{host_if}")
            run("ip", "link", "set", ns_if, "netns", ns)
            run("ip", "link", "set", host_if, "master", br)
            run("ip", "link", "set", host_if, "up")
            run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.node_ip(i)}/24",
                "dev", ns_if)  # fmt: skip
            run("ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up")
            run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")

    def cut(self, i: int, cut: bool) -> None:
        """Take node ``i``'s link down (packets dropped both ways, no reset) or up again."""
        run("ip", "link", "set", f"{self.tag}h{i}", "down" if cut else "up")

    def slow(self, i: int, slow: bool) -> None:
        """Shape both ends of node ``i``'s link to :data:`SLOW_RATE` (``tc tbf``), or not."""
        ends = [[], ["ip", "netns", "exec", self.ns(i)]]
        for prefix, dev in zip(ends, (f"{self.tag}h{i}", f"{self.tag}c{i}"), strict=True):
            if slow:
                run(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                    SLOW_RATE, "burst", "64kb", "latency", "400ms")  # fmt: skip
            else:
                with contextlib.suppress(subprocess.CalledProcessError):
                    run(*prefix, "tc", "qdisc", "del", "dev", dev, "root")

    def destroy(self) -> None:
        for item in reversed(self.made):
            kind, name = item.split(":", 1)
            cmd = ("ip", "netns", "del", name) if kind == "netns" else ("ip", "link", "del", name)
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                run(*cmd)
        self.made.clear()


def netns_permitted() -> str:
    """Empty if this process may build namespaces, else why not."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "ip or tc is not installed"
    probe = f"kvprobe{os.getpid() % 100000}"
    try:
        run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"ip netns add is not permitted here ({exc})"
    with contextlib.suppress(subprocess.CalledProcessError):
        run("ip", "netns", "del", probe)
    return ""


class Cluster:
    """Redis, two masters, the nodes; each process restartable on its port."""

    def __init__(self, nodes: int, lease_s: float, net: Net | None) -> None:
        self.net = net
        self.host = net.host_ip if net else "127.0.0.1"
        self.lease_s = lease_s
        self.redis_port = free_port("127.0.0.1")
        self.redis: subprocess.Popen[bytes] | None = None
        self.master_ports: list[int] = []  # (chosen once the bridge exists)
        self.masters: list[Serve | None] = [None, None]
        self.node_hosts = [net.node_ip(i) if net else "127.0.0.1" for i in range(nodes)]
        self.node_ports = [free_port("127.0.0.1") for _ in range(nodes)]
        self.nodes: list[Serve | None] = [None] * nodes

    @property
    def master_list(self) -> list[str]:
        return [f"{self.host}:{p}" for p in self.master_ports]

    def start(self) -> None:
        self.master_ports = [free_port(self.host) for _ in range(2)]
        self.redis = subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.redis_port), timeout=0.5),
            ):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        for i in range(2):
            self.start_master(i)
        for i in range(len(self.nodes)):
            self.start_node(i)

    def start_master(self, i: int) -> None:
        self.masters[i] = Serve.start(
            "--redis", f"redis://127.0.0.1:{self.redis_port}/0", "--host", self.host,
            "--grpc-port", str(self.master_ports[i]), "--metrics-port", "0",
            "--node-lease-s", str(self.lease_s), "--log-level", "ERROR", "--insecure",
            command="master",
        )  # fmt: skip

    def start_node(self, i: int) -> None:
        masters = self.master_list
        order = masters[i % 2 :] + masters[: i % 2]  # heartbeats to both masters
        prefix = ["ip", "netns", "exec", self.net.ns(i)] if self.net else []
        self.nodes[i] = Serve.start(
            "--master", ",".join(order), "--host", self.node_hosts[i],
            "--data-port", str(self.node_ports[i]), "--metrics-port", "0",
            "--node-id", f"chaos-n{i}", "--host-mem", "64MiB", "--log-level", "ERROR",
            "--insecure", command="node", prefix=prefix,
        )  # fmt: skip

    def commit_links(self) -> list[float | None]:
        """Each master's ``kvstore_commit_links_total`` now (None: down or unreadable): the
        nodes' connections to its commit port that carried commits since it last started."""
        out: list[float | None] = []
        for master in self.masters:
            found = None
            if master is not None and master.proc.poll() is None:
                url = f"http://{master.addresses['metrics']}/metrics"
                with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as r:
                    for line in r.read().decode().splitlines():
                        if line.startswith("kvstore_commit_links_total "):
                            found = float(line.split()[1])
            out.append(found)
        return out

    @staticmethod
    def kill(proc: Serve | None) -> None:
        if proc is None:
            return
        if proc.proc.poll() is None:
            proc.proc.kill()
        proc.proc.wait(10)
        proc.stderr.close()

    def stop(self) -> None:
        for srv in [*self.nodes, *self.masters]:
            if srv is not None:
                if srv.proc.poll() is None:
                    srv.proc.send_signal(signal.SIGCONT)
                with contextlib.suppress(Exception):
                    srv.stop(timeout=10)
        if self.redis is not None:
            self.redis.terminate()
            self.redis.wait(10)


# ---- faults -----------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    target: str
    at: float
    healed_at: float = 0.0


class Injector:
    def __init__(self, cluster: Cluster, kinds: list[str], rng: random.Random) -> None:
        self.cluster = cluster
        self.kinds = kinds
        self.rng = rng
        self.count = 0

    async def inject(self, now: float) -> tuple[Fault, Any]:
        """Inject the next fault; returns it and the coroutine function that heals it."""
        c = self.cluster
        kind = self.kinds[self.count % len(self.kinds)]
        self.count += 1
        if kind == "kill-master":
            i = self.rng.randrange(2)
            Cluster.kill(c.masters[i])
            return Fault(kind, f"master-{i}", now), lambda: asyncio.to_thread(c.start_master, i)
        i = self.rng.randrange(len(c.nodes))
        target = f"chaos-n{i}"
        node = c.nodes[i]
        assert node is not None
        if kind == "kill-node":
            Cluster.kill(node)
            return Fault(kind, target, now), lambda: asyncio.to_thread(c.start_node, i)
        if kind == "stop-node":
            node.proc.send_signal(signal.SIGSTOP)
            return Fault(kind, target, now), _signal_later(node, signal.SIGCONT)
        assert c.net is not None
        net = c.net
        change = net.cut if kind == "cut-node" else net.slow
        await asyncio.to_thread(change, i, True)
        return Fault(kind, target, now), lambda: asyncio.to_thread(change, i, False)


def _signal_later(node: Serve, sig: int) -> Any:
    async def heal() -> None:
        node.proc.send_signal(sig)

    return heal


# ---- workload ---------------------------------------------------------------------------


@dataclass
class Op:
    start: float
    end: float
    kind: str
    outcome: str
    """``ok``, ``short`` (fewer tokens than stored), or the exception's type name."""


@dataclass
class Log:
    t0: float
    ops: list[Op] = field(default_factory=list)
    wrong_bytes: int = 0
    checked_bytes: int = 0
    written: collections.deque[tuple[int, list[int]]] = field(
        default_factory=lambda: collections.deque(maxlen=RECENT)
    )

    def add(self, start: float, kind: str, outcome: str) -> None:
        self.ops.append(Op(start - self.t0, time.monotonic() - self.t0, kind, outcome))


async def _client(masters: list[str]) -> kvclient.KVClient:
    """A client of both masters; retried for up to 60 s (a loaded machine starts slowly)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return await kvclient.KVClient.connect(
                masters, NS, replicas=2, min_replicas=1, timeout_s=OP_TIMEOUT_S
            )
        except KVStoreError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def writer(masters: list[str], index: int, log: Log, stop: asyncio.Event) -> None:
    async with await _client(masters) as kv:
        seed = (index + 1) * 10_000_000
        while not stop.is_set():
            seed += 1
            tokens, stored = tokens_of(seed), []
            for layer in range(LAYERS):
                t = time.monotonic()
                try:
                    n = await kv.put_layer(tokens, layer, kv_of(seed, layer))
                except KVStoreError as exc:
                    log.add(t, "put", type(exc).__name__)
                    stored.append(0)
                    continue
                log.add(t, "put", "ok" if n == TOKENS else "short")
                stored.append(n)
            if any(stored):
                log.written.append((seed, stored))


async def reader(
    masters: list[str], index: int, log: Log, stop: asyncio.Event, rng: random.Random
) -> None:
    async with await _client(masters) as kv:
        while not stop.is_set():
            if not log.written:
                await asyncio.sleep(0.05)
                continue
            seed, stored = rng.choice(list(log.written))
            layer = rng.choice([i for i, n in enumerate(stored) if n])
            tokens = tokens_of(seed)
            t = time.monotonic()
            try:
                await kv.match_prefix(tokens)
                log.add(t, "match", "ok")
            except KVStoreError as exc:
                log.add(t, "match", type(exc).__name__)
            t = time.monotonic()
            try:
                got = await kv.get_layer(tokens, layer)
            except KVStoreError as exc:
                log.add(t, "get", type(exc).__name__)
                continue
            n = got.shape[1]
            want = kv_of(seed, layer)[:, :n].contiguous().view(torch.uint8)
            have = got.contiguous().view(torch.uint8)
            same = have.shape == want.shape
            log.wrong_bytes += int((have != want).sum()) if same else want.numel()
            log.checked_bytes += want.numel()
            log.add(t, "get", "ok" if n >= stored[layer] else "short")


# ---- the run ----------------------------------------------------------------------------


async def chaos(args: argparse.Namespace, cluster: Cluster, kinds: list[str]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    log = Log(time.monotonic())
    stop = asyncio.Event()
    masters = cluster.master_list
    tasks = [asyncio.create_task(writer(masters, i, log, stop)) for i in range(args.writers)]
    tasks += [
        asyncio.create_task(reader(masters, i, log, stop, random.Random(args.seed * 100 + i)))
        for i in range(args.readers)
    ]
    injector = Injector(cluster, kinds, rng)
    faults: list[Fault] = []
    end = log.t0 + args.duration
    healing: asyncio.Task[None] | None = None

    async def heal_later(fault: Fault, heal: Any) -> None:
        await asyncio.sleep(args.every / 2)
        await heal()
        fault.healed_at = time.monotonic() - log.t0

    with progress() as bar:
        task = bar.add_task("chaos", total=int(args.duration))
        # On a fixed schedule (a calm start first), each fault healed in the background.
        next_fault = log.t0 + min(args.every, args.duration) / 2
        planned = args.rounds * len(kinds)
        while (now := time.monotonic()) < end:
            bar.update(task, completed=int(now - log.t0),
                       description=f"chaos: {len(log.ops)} ops, {len(faults)} faults, "
                                   f"{log.wrong_bytes} wrong bytes")  # fmt: skip
            if planned and len(faults) >= planned:
                if healing is None or healing.done():
                    break  # every round injected and healed
            elif now >= next_fault and now + args.every / 2 < end:
                if healing is not None:  # (a restart still under way: faults never overlap)
                    await healing
                fault, heal = await injector.inject(time.monotonic() - log.t0)
                faults.append(fault)
                healing = asyncio.create_task(heal_later(fault, heal))
                next_fault += args.every
            await asyncio.sleep(0.2)
        if healing is not None:
            await healing
        bar.update(task, completed=int(args.duration))
    elapsed = time.monotonic() - log.t0
    stop.set()
    done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    crashed = [repr(r) for r in done if isinstance(r, BaseException)]
    return summarize(args, elapsed, log, faults, crashed, kinds)


def summarize(
    args: argparse.Namespace,
    elapsed: float,
    log: Log,
    faults: list[Fault],
    crashed: list[str],
    kinds: list[str],
) -> dict[str, Any]:
    ops = log.ops
    duration = max([elapsed, *(o.end for o in ops)])
    seconds = int(duration) + 1
    per_s = [[0, 0, 0, 0] for _ in range(seconds)]  # ops, without error, gets, full gets
    for o in ops:
        row = per_s[min(int(o.start), seconds - 1)]
        row[0] += 1
        row[1] += o.outcome in ("ok", "short")
        if o.kind == "get":
            row[2] += 1
            row[3] += o.outcome == "ok"
    availability = [r[1] / r[0] if r[0] else None for r in per_s]
    fault_rows = []
    bounds = [f.at for f in faults[1:]] + [duration]
    for f, until in zip(faults, bounds, strict=True):
        window = [o for o in ops if f.at <= o.end < until]
        errors = [o for o in window if o.outcome not in ("ok", "short")]
        fault_rows.append({
            "at_s": round(f.at, 2), "kind": f.kind, "target": f.target,
            "healed_after_s": round(f.healed_at - f.at, 2), "ops": len(window),
            "errors": len(errors), "short_reads": sum(o.outcome == "short" for o in window),
            "errors_for_s": round(max((o.end for o in errors), default=f.at) - f.at, 2),
        })  # fmt: skip
    kinds_seen = sorted({o.kind for o in ops})
    by_kind = {}
    for kind in kinds_seen:
        mine = [o for o in ops if o.kind == kind]
        lat = [(o.end - o.start) * 1000 for o in mine]
        errors = collections.Counter(o.outcome for o in mine if o.outcome not in ("ok", "short"))
        by_kind[kind] = {
            "ops": len(mine), "ok": sum(o.outcome == "ok" for o in mine),
            "short": sum(o.outcome == "short" for o in mine), "errors": dict(errors),
            "p50_ms": round(percentile(lat, 50), 2), "p99_ms": round(percentile(lat, 99), 2),
        }  # fmt: skip
    valid = [a for a in availability if a is not None]
    return {
        "duration_s": round(elapsed, 1),
        "every_s": args.every,
        "nodes": args.nodes,
        "writers": args.writers,
        "readers": args.readers,
        "lease_s": args.lease_s,
        "netns": "on" if set(NET_FAULTS) & set(kinds) else "off",
        "fault_kinds": kinds,
        "ops": len(ops),
        "wrong_bytes": log.wrong_bytes,
        "checked_bytes": log.checked_bytes,
        "crashed_tasks": crashed,
        "by_kind": by_kind,
        "faults": fault_rows,
        "availability": {
            "per_second": [None if a is None else round(a, 4) for a in availability],
            "mean": round(statistics.fmean(valid), 4) if valid else None,
            "min": round(min(valid), 4) if valid else None,
            "seconds_below_99": sum(a < 0.99 for a in valid),
            "seconds_with_ops": len(valid),
        },
        "full_reads_per_second": [round(r[3] / r[2], 4) if r[2] else None for r in per_s],
    }


def tables(result: dict[str, Any], skipped: str) -> list[Table]:
    setup = Table("Setup", ["setting", "value"])
    for key in ("duration_s", "every_s", "nodes", "writers", "readers", "lease_s", "netns"):
        setup.add(key, result[key])
    setup.add("faults", ", ".join(result["fault_kinds"]))
    setup.notes.append(
        f"2 masters on one Redis, replicas=2, min_replicas=1, quant none, {TOKENS}-token "
        f"prompts of {LAYERS} layers in {BLOCK}-token blocks, op timeout {OP_TIMEOUT_S:g} s."
    )
    if skipped:
        setup.notes.append(f"network faults skipped: {skipped}")
    links = ", ".join(f"master-{i} {'down' if n is None else int(n)}"
                      for i, n in enumerate(result.get("commit_links", [])))  # fmt: skip
    setup.notes.append(
        f"nodes' connections to each master's commit port that carried commits, at the end "
        f"(since that master's last start): {links}"
    )
    ops = Table("Operations", ["op", "count", "ok", "short", "errors", "p50 ms", "p99 ms"])
    for kind, row in result["by_kind"].items():
        errors = ", ".join(f"{k} {v}" for k, v in sorted(row["errors"].items())) or "0"
        ops.add(kind, row["ops"], row["ok"], row["short"], errors, row["p50_ms"], row["p99_ms"])
    ops.notes.append(
        f"wrong bytes: **{result['wrong_bytes']}** of {result['checked_bytes']:,} checked; "
        "short: a read returned fewer tokens than were stored (both copies lost), or a put "
        "stored fewer than it was given."
    )
    if result["crashed_tasks"]:
        ops.notes.append(f"client tasks that crashed: {result['crashed_tasks']}")
    faults = Table("Faults", ["at s", "fault", "target", "healed after s", "ops", "errors",
                              "short", "errors for s"])  # fmt: skip
    for f in result["faults"]:
        faults.add(f["at_s"], f["kind"], f["target"], f["healed_after_s"], f["ops"],
                   f["errors"], f["short_reads"], f["errors_for_s"])  # fmt: skip
    faults.notes.append(
        "errors for s: from the fault's injection to the end of the last operation that "
        "failed before the next fault (0: none failed); ops, errors and short count the "
        "operations that ended in that window. healed after s: until the restarted "
        "process was ready again (or SIGCONT, or the link restored)."
    )
    recovery = Table("Recovery by fault", ["fault", "injected", "errors", "errors for s, mean",
                                           "errors for s, max"])  # fmt: skip
    for kind in result["fault_kinds"]:
        rows = [f for f in result["faults"] if f["kind"] == kind]
        if rows:
            spans = [f["errors_for_s"] for f in rows]
            recovery.add(kind, len(rows), sum(f["errors"] for f in rows),
                         round(statistics.fmean(spans), 2), max(spans))  # fmt: skip
    av = result["availability"]
    avail = Table("Availability per second", ["seconds with ops", "mean", "min", "seconds < 99%"])
    avail.add(av["seconds_with_ops"], av["mean"], av["min"], av["seconds_below_99"])
    avail.notes.append("availability: operations that raised no error ÷ operations, per second.")
    return [setup, ops, faults, recovery, avail]


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 4))
    av = result["availability"]["per_second"]
    full = result["full_reads_per_second"]
    xs = list(range(len(av)))
    ax.plot(xs, [a if a is not None else float("nan") for a in av], label="availability")
    ax.plot(xs, [a if a is not None else float("nan") for a in full], label="full reads",
            alpha=0.6)  # fmt: skip
    colors = {"kill-node": "red", "stop-node": "orange", "kill-master": "purple",
              "cut-node": "brown", "slow-node": "gray"}  # fmt: skip
    for f in result["faults"]:
        ax.axvspan(f["at_s"], f["at_s"] + f["healed_after_s"], alpha=0.15,
                   color=colors.get(f["kind"], "black"))  # fmt: skip
        ax.text(f["at_s"], 1.02, f["kind"], fontsize=6, rotation=45)
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction per second")
    ax.set_title(f"chaos: {result['ops']} ops, wrong bytes {result['wrong_bytes']}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--every", type=float, default=20.0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="end after every fault kind was injected this many times",
    )
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--lease-s", type=float, default=6.0)
    parser.add_argument("--netns", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--plot", default="")
    parser.add_argument("--json", default="")
    args = explain(parser, __doc__).parse_args(argv)
    if args.nodes < 3 or args.every <= 0 or args.duration <= 0 or args.rounds < 0:
        parser.error("--nodes >= 3, --every and --duration > 0, --rounds >= 0")
    skipped = "off (--netns off)" if args.netns == "off" else netns_permitted()
    if args.netns == "on" and skipped:
        parser.error(skipped)
    net = None
    if not skipped:
        tag = f"kvc{os.getpid() % 10000}"
        net = Net(tag, f"10.{77 + os.getpid() % 100}.{os.getpid() // 100 % 250}", args.nodes)
    kinds = [k for k in FAULTS if net is not None or k not in NET_FAULTS]
    cluster = Cluster(args.nodes, args.lease_s, net)
    try:
        if net is not None:
            net.create()
        cluster.start()
        result = asyncio.run(chaos(args, cluster, kinds))
        result["commit_links"] = cluster.commit_links()
    finally:
        cluster.stop()
        if net is not None:
            net.destroy()
    print_report("The pool under faults", "bench/chaos.py", argv, tables(result, skipped))
    if args.plot:
        plot(result, args.plot)
        print(f"Plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if result["wrong_bytes"] or result["crashed_tasks"] else 0


if __name__ == "__main__":
    sys.exit(main())

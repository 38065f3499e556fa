"""``kvctl`` against a real master: a ``grpc.aio`` master on 127.0.0.1:0 in the test's loop,
nodes registered and blocks committed through :class:`MasterClient`, and ``kvctl.main.main``
run in a worker thread (its own event loop) or, twice, as a subprocess. ``kvctl top`` runs
against a real ``kvstore serve`` subprocess that carried a little traffic."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

import kvclient
from kvctl.explain import explain_prefix, format_ranges, report_json
from kvctl.main import main
from kvstore import __version__
from kvstore.core.hashing import Namespace, block_hashes
from kvstore.core.kvgen import realistic_kv
from kvstore.errors import ProtocolError
from kvstore.master import (
    BlockAdd,
    CommitBatch,
    Holder,
    MasterClient,
    MasterConfig,
    MasterServer,
    MasterService,
    Membership,
    MemoryIndexStore,
    NodeInfo,
    ObjectAdd,
    Tier,
)
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from tests.cluster import Server, start_server

NS = Namespace(
    model="llama-test",
    revision="r1",
    num_layers=4,
    num_kv_heads=2,
    head_dim=8,
    block_tokens=4,
    tp_size=2,
)
NS_ARGS = [
    *("--model", "llama-test", "--revision", "r1", "--layers", "4", "--kv-heads", "2"),
    *("--head-dim", "8", "--block-tokens", "4", "--tp-size", "2"),
]
TOKENS = list(range(1000, 1018))  # 4 full blocks of 4 tokens + a 2-token tail
HASHES = block_hashes(NS, TOKENS)
ALL = tuple(range(8))  # every chunk: 4 layers x 2 shards
TOKENS_ARG = ",".join(map(str, TOKENS))

REFUSED = "(unavailable: connection refused: nothing listens there)\n"
"""How kvctl's one line ends for a master address where nothing listens."""


@dataclass
class Run:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


async def kvctl(*argv: str, stdin: str = "") -> Run:
    """``kvctl argv`` in a worker thread, as the console script runs it."""
    out, err = io.StringIO(), io.StringIO()
    rc = await asyncio.to_thread(main, list(argv), stdin=io.StringIO(stdin), stdout=out, stderr=err)
    return Run(rc, out.getvalue(), err.getvalue())


@dataclass
class Cluster:
    server: MasterServer
    client: MasterClient

    @property
    def m(self) -> list[str]:
        return ["--master", self.server.address]


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    server = MasterServer(MasterConfig(grpc_port=0))
    await server.start()
    client = MasterClient(server.address, timeout_s=5)
    try:
        yield Cluster(server, client)
        server.membership.validate()
        assert isinstance(server.store, MemoryIndexStore)
        server.store.validate()
    finally:
        await client.close()
        await server.stop(grace=0.5)


def adds(*blocks: tuple[int, tuple[int, ...]]) -> tuple[BlockAdd, ...]:
    return tuple(BlockAdd(NS.id, HASHES[i], chunks) for i, chunks in blocks)


@contextlib.contextmanager
def dead_port() -> Iterator[int]:
    """A port that refuses connections: bound, never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


# -- status, nodes, stats, drain ----------------------------------------------------------------


async def test_status_nodes_stats_and_drain(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = cluster.client
    ea = (await c.register("a", "tcp://127.0.0.1:7001", tiers=[Tier("host", 1000, 100)])).epoch
    eb = (
        await c.register(
            "b",
            "tcp://127.0.0.1:7002",
            transport="ucx",
            tiers=[Tier("host", 2000, 0), Tier("gpu", 500, 50)],
            version="0.1.0",
        )
    ).epoch
    await c.commit(
        CommitBatch(
            "a", ea, 1, adds((0, ALL), (1, ALL), (2, ALL)), object_adds=(ObjectAdd("k", 9),)
        )
    )
    totals = {
        "nodes": 2,
        "live_nodes": 2,
        "capacity_bytes": 3500,
        "used_bytes": 150,
        "blocks": 3,
        "objects": 1,
        "hits": 0,
        "misses": 0,
    }
    status = await kvctl(*cluster.m, "status", "--json")
    assert (status.rc, status.err) == (0, "")
    assert status.json() == totals
    assert list(status.json()) == list(totals), "the documented key order"

    monkeypatch.setenv("KVSTORE_MASTER", cluster.server.address)
    nodes = (await kvctl("nodes", "--json")).json()
    assert list(nodes) == ["nodes"]
    assert [list(n) for n in nodes["nodes"]] == [
        ["id", "alive", "lease_age_s", "epoch", "data", "tiers"]
    ] * 2
    for n in nodes["nodes"]:
        assert isinstance(n["lease_age_s"], float) and 0 <= n["lease_age_s"] < 5
    assert [(n["id"], n["alive"], n["epoch"], n["data"], n["tiers"]) for n in nodes["nodes"]] == [
        ("a", True, ea, "tcp://127.0.0.1:7001", [tier("host", 1000, 100)]),
        ("b", True, eb, "tcp://127.0.0.1:7002", [tier("host", 2000, 0), tier("gpu", 500, 50)]),
    ]

    stats = await kvctl("stats", "--json", "--master", cluster.server.address)
    assert stats.json() == {
        **totals,
        "hit_ratio": None,
        "tiers": [
            {"name": "gpu", "nodes": 1, "capacity_bytes": 500, "used_bytes": 50},
            {"name": "host", "nodes": 2, "capacity_bytes": 3000, "used_bytes": 100},
        ],
        "tenants": [],  # (no auth file: no tenants)
    }
    assert "gpu" in (await kvctl("stats")).out
    assert "2 (2 live)" in (await kvctl("status")).out

    assert (await kvctl("drain", "b", "--json")).json() == {"node": "b", "draining": True}
    table = await kvctl("nodes")
    assert table.rc == 0
    rows = {line.split()[0]: line for line in table.out.splitlines() if line.strip()}
    assert "alive, draining" in rows["b"] and "ucx" in rows["b"] and "0.1.0" in rows["b"]
    assert "draining" not in rows["a"] and "tcp" in rows["a"]
    assert (await kvctl("drain", "b", "--undrain")).out == "node b: not draining\n"
    assert not (await c.nodes())[1].draining

    ghost = await kvctl("drain", "ghost")
    assert (ghost.rc, ghost.out) == (1, "")
    assert ghost.err.count("\n") == 1 and "unknown node 'ghost'" in ghost.err

    # A node that died is alive at the master until its lease ends: waiting on its drain
    # names its data port, not the master (which answers).
    with dead_port() as port:
        await c.register("c", f"tcp://127.0.0.1:{port}", tiers=[Tier("host", 1000, 0)])
        dead = await kvctl("drain", "c", "--wait", "--wait-s", "1")
    assert dead.rc == 1 and dead.err.count("\n") == 1, dead
    assert "drain of node c not done within 1 s" in dead.err and f":{port} does not" in dead.err


def tier(name: str, capacity: int, used: int) -> dict[str, Any]:
    return {"name": name, "capacity_bytes": capacity, "used_bytes": used}


# -- lookup -----------------------------------------------------------------------------------


async def test_lookup_explains_missing_layer_no_holder_and_partial_tail(
    cluster: Cluster, tmp_path: Path
) -> None:
    c = cluster.client
    ea = (await c.register("a", "tcp://127.0.0.1:7001")).epoch
    ec = (await c.register("c", "tcp://127.0.0.1:7003")).epoch
    # Block 1 lacks chunk 5 = layer 2 of shard 1; block 3 is nowhere.
    await c.commit(CommitBatch("a", ea, 1, adds((0, ALL), (1, (0, 1, 2, 3, 4, 6, 7)), (2, ALL))))

    run = await kvctl(*cluster.m, "lookup", *NS_ARGS, "--tokens", TOKENS_ARG, "--json")
    assert (run.rc, run.err) == (0, "")
    doc = run.json()
    assert doc["namespace"]["id"] == NS.id_hex
    assert (doc["tokens"], doc["full_blocks"], doc["tail_tokens"]) == (18, 4, 2)
    assert (doc["matched_blocks"], doc["matched_tokens"], doc["master_matched_blocks"]) == (1, 4, 1)
    assert doc["stop"] == {
        "block": 1,
        "reason": "missing_layers",
        "detail": "shard 1: layer 2 missing",
    }
    assert doc["notes"] == []
    assert [b["hash"] for b in doc["blocks"]] == [h.hex() for h in HASHES]
    assert [b["status"] for b in doc["blocks"]] == ["ok", "missing_layers", "ok", "no_holder"]
    block1 = doc["blocks"][1]
    assert block1["holders"] == [
        {"node": "a", "epoch": ea, "state": "alive", "data": "tcp://127.0.0.1:7001", "chunks": 7}
    ]
    assert block1["shards"] == [
        {"shard": 0, "layers_present": 4, "layers": 4, "missing_layers": []},
        {"shard": 1, "layers_present": 3, "layers": 4, "missing_layers": [[2, 2]]},
    ]
    assert doc["blocks"][3]["holders"] == []
    assert doc["blocks"][3]["shards"][0]["missing_layers"] == [[0, 3]]

    table = await kvctl(*cluster.m, "lookup", *NS_ARGS, "--tokens", TOKENS_ARG)
    assert "stops at block 1: missing_layers" in table.out
    assert "s1 3/4 missing 2" in table.out and "no_holder" in table.out

    # Node c fills the hole and block 3: the whole prompt matches but its 2-token tail.
    await c.commit(CommitBatch("c", ec, 1, adds((1, (5,)), (3, ALL))))
    tokens_file = tmp_path / "prompt.json"
    tokens_file.write_text(json.dumps(TOKENS))
    doc = (
        await kvctl(*cluster.m, "lookup", *NS_ARGS, "--tokens-file", str(tokens_file), "--json")
    ).json()
    assert (doc["matched_blocks"], doc["master_matched_blocks"]) == (4, 4)
    assert doc["stop"]["block"] == 4 and doc["stop"]["reason"] == "partial_tail"
    assert [(h["node"], h["chunks"]) for h in doc["blocks"][1]["holders"]] == [("a", 7), ("c", 1)]

    exact = " ".join(map(str, TOKENS[:16])) + "\n"
    doc = (
        await kvctl(*cluster.m, "lookup", *NS_ARGS, "--tokens-file", "-", "--json", stdin=exact)
    ).json()
    assert (doc["matched_tokens"], doc["tail_tokens"], doc["stop"]) == (16, 0, None)

    # Each lookup's MatchPrefix counts toward the master's hits and misses (in blocks).
    status = (await kvctl(*cluster.m, "status", "--json")).json()
    assert (status["hits"], status["misses"]) == (1 + 1 + 4 + 4, 3 + 3 + 0 + 0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def master_without_sweeper(clock: FakeClock, lease_s: float) -> AsyncIterator[MasterClient]:
    """The real servicer without the lease sweeper, so an expired lease stays visible: the
    index keeps the holder (Lookup, MatchPrefix) while Nodes() already reports it dead."""
    store = MemoryIndexStore()
    service = MasterService(store, Membership(lease_s), clock=clock)
    server = grpc.aio.server()
    pb_grpc.add_MasterServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = MasterClient(f"127.0.0.1:{port}", timeout_s=5)
    try:
        yield client
        service.membership.validate()
        store.validate()
    finally:
        await client.close()
        await server.stop(0)
        await store.close()


async def test_lookup_flags_a_holder_whose_lease_expired() -> None:
    clock = FakeClock()
    async with master_without_sweeper(clock, lease_s=10.0) as c:
        es = (await c.register("s", "tcp://127.0.0.1:7005")).epoch
        eb = (await c.register("b", "tcp://127.0.0.1:7006")).epoch
        await c.commit(CommitBatch("s", es, 1, adds((0, ALL))))
        await c.commit(CommitBatch("b", eb, 1, adds((1, ALL))))
        clock.now += 11.0  # both leases expired; s comes back, b stays silent
        assert (await c.heartbeat("s", es)).ok
        m = ["--master", c.target]

        nodes = {n["id"]: n for n in (await kvctl(*m, "nodes", "--json")).json()["nodes"]}
        assert (nodes["b"]["alive"], nodes["b"]["lease_age_s"]) == (False, 11.0)
        assert (nodes["s"]["alive"], nodes["s"]["lease_age_s"]) == (True, 0.0)
        assert (await kvctl(*m, "status", "--json")).json()["live_nodes"] == 1

        doc = (await kvctl(*m, "lookup", *NS_ARGS, "--tokens", TOKENS_ARG, "--json")).json()
        assert [b["status"] for b in doc["blocks"]] == [
            "ok",
            "holder_dead",
            "no_holder",
            "no_holder",
        ]
        assert [(h["node"], h["state"]) for h in doc["blocks"][1]["holders"]] == [("b", "dead")]
        assert (doc["matched_blocks"], doc["master_matched_blocks"]) == (1, 2)
        assert doc["stop"]["reason"] == "holder_dead" and f"b@{eb} (dead)" in doc["stop"]["detail"]
        assert len(doc["notes"]) == 1 and "lease expired" in doc["notes"][0]

        clock.now += 6.0  # s silent for more than half a lease: suspect, still read from
        doc = (await kvctl(*m, "lookup", *NS_ARGS, "--tokens", TOKENS_ARG, "--json")).json()
        assert doc["blocks"][0]["status"] == "ok"
        assert doc["blocks"][0]["holders"][0]["state"] == "suspect"
        assert "suspect" in (await kvctl(*m, "nodes")).out


def node_info(node_id: str, epoch: int) -> NodeInfo:
    return NodeInfo(node_id, True, False, False, 0.0, epoch, "tcp://x:1", "tcp", b"", (), "", "")


def test_explain_unknown_and_stale_epoch_holders() -> None:
    ns = Namespace(
        model="m", revision="r", num_layers=4, num_kv_heads=1, head_dim=8, block_tokens=2
    )
    hashes = block_hashes(ns, [1, 2, 3, 4])
    located = [
        [Holder("x", "tcp://x:1", 3, 0b1111)],  # x is not in Nodes()
        [Holder("y", "tcp://y:1", 1, 0b0011), Holder("z", "tcp://z:1", 5, 0b0100)],
    ]
    nodes = [node_info("y", 2), node_info("z", 5)]  # y re-registered since
    report = explain_prefix(ns, 4, hashes, located, nodes, master_matched_blocks=1)
    doc = report_json(report)
    assert [[h["state"] for h in b["holders"]] for b in doc["blocks"]] == [
        ["unknown"],
        ["stale_epoch", "alive"],
    ]
    assert [b["status"] for b in doc["blocks"]] == ["holder_dead", "missing_layers"]
    assert doc["blocks"][1]["shards"] == [
        {"shard": 0, "layers_present": 1, "layers": 4, "missing_layers": [[0, 1], [3, 3]]}
    ]
    assert doc["stop"] == {
        "block": 0,
        "reason": "holder_dead",
        "detail": "layers 0-3 missing; indexed only on unreadable holders: x@3 (unknown)",
    }
    assert report.matched_blocks == 0 and len(report.notes) == 1
    assert format_ranges(((0, 1), (3, 3), (5, 9))) == "0-1, 3, 5-9"
    with pytest.raises(ProtocolError):
        explain_prefix(ns, 4, hashes, located[:1], nodes, 0)


# -- errors and exit codes ----------------------------------------------------------------------


async def test_usage_errors_exit_2_before_calling_the_master(tmp_path: Path) -> None:
    with dead_port() as port:
        m = ["--master", f"127.0.0.1:{port}"]
        cases: list[tuple[list[str], str]] = [
            ([], "required: COMMAND"),
            ([*m, "evict"], "the following arguments are required: --model"),
            ([*m, "evict", *NS_ARGS, "--tokens", "1,x"], "kvctl: tokens must be integers"),
            (["--timeout", "0", "status"], "must be > 0"),
            ([*m, "drain"], "required: NODE"),
            ([*m, "lookup", *NS_ARGS], "one of the arguments --tokens --tokens-file is required"),
            ([*m, "lookup", *NS_ARGS, "--tokens", "1,x"], "kvctl: tokens must be integers"),
            ([*m, "lookup", *NS_ARGS, "--tokens", "[1, -2]"], "kvctl: token ids must lie in"),
            (
                [*m, "lookup", *NS_ARGS, "--tokens-file", str(tmp_path / "none")],
                "kvctl: cannot read tokens file",
            ),
            ([*m, "lookup", *NS_ARGS, "--layers", "0", "--tokens", "1"], "num_layers"),
            ([*m, "lookup", *NS_ARGS, "--dtype", "int4", "--tokens", "1"], "unsupported KV dtype"),
        ]
        for argv, message in cases:
            run = await kvctl(*argv)
            assert (run.rc, run.out) == (2, ""), argv
            assert message in run.err, (argv, run.err)
        helped = await kvctl("lookup", "--help")
        assert helped.rc == 0 and "--tokens-file" in helped.out and helped.err == ""


async def test_unreachable_master_exits_1_with_one_line() -> None:
    with dead_port() as port:
        run = await kvctl("--master", f"127.0.0.1:{port}", "--timeout", "2", "status", "--json")
    assert (run.rc, run.out) == (1, "")
    assert run.err == f"kvctl: cannot reach master at 127.0.0.1:{port} {REFUSED}"


# -- subprocesses: the import budget and the console script -----------------------------------

_IMPORT_PROBE = """
import json, sys
from kvctl.main import main

HEAVY = ("grpc", "rich", "numpy", "torch", "nixl", "nixl_cu12")

def loaded():
    return sorted(m for m in HEAVY if m in sys.modules)

seen = {"help": [main(["--help"]), loaded()]}
seen["status --json"] = [main([*sys.argv[1:], "status", "--json"]), loaded()]
seen["status"] = [main([*sys.argv[1:], "status"]), loaded()]
print("PROBE " + json.dumps(seen))
"""


async def test_cold_path_imports_neither_torch_nor_numpy(cluster: Cluster) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _IMPORT_PROBE,
        *cluster.m,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    probe = [line for line in out.decode().splitlines() if line.startswith("PROBE ")]
    assert json.loads(probe[0].removeprefix("PROBE ")) == {
        "help": [0, []],
        "status --json": [0, ["grpc"]],
        "status": [0, ["grpc", "rich"]],
    }


async def test_console_script_exit_code_and_message() -> None:
    script = Path(sys.executable).with_name("kvctl")
    if not script.exists():
        pytest.skip(f"console script not installed next to {sys.executable}")
    with dead_port() as port:
        proc = await asyncio.create_subprocess_exec(
            str(script),
            "--master",
            f"127.0.0.1:{port}",
            "nodes",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert (proc.returncode, out) == (1, b"")
    assert err.decode() == f"kvctl: cannot reach master at 127.0.0.1:{port} {REFUSED}"


def test_long_lookup_table_shows_the_head_and_the_rows_around_the_stop() -> None:
    from kvctl.tables import print_lookup

    ns = Namespace(
        model="m", revision="r", num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=1
    )
    hashes = block_hashes(ns, list(range(40)))
    located = [[Holder("a", "tcp://a:1", 7, 0b11)] if i < 30 else [] for i in range(40)]
    report = explain_prefix(ns, 40, hashes, located, [node_info("a", 7)], 30)
    out = io.StringIO()
    print_lookup(report, out)
    rows = [line.split() for line in out.getvalue().splitlines() if line.strip()]
    first = [row[0] for row in rows if row and (row[0].isdigit() or "-" in row[0])]
    assert first == ["0", "1", "2", "3-26", *map(str, range(27, 38)), "38-39"]
    assert next(r for r in rows if r[0] == "3-26") == ["3-26", "...", "24", "ok"]
    assert next(r for r in rows if r[0] == "38-39") == ["38-39", "...", "2", "no_holder"]
    assert "stops at block 30: no_holder" in out.getvalue()


# -- kvctl --version and kvctl top ---------------------------------------------------------------


async def test_version_prints_the_package_version() -> None:
    run = await kvctl("--version")
    assert (run.rc, run.out, run.err) == (0, f"kvctl {__version__}\n", "")


@pytest.fixture(scope="module")
def pool() -> Iterator[Server]:
    """``kvstore serve`` with a 1 MiB pool that took 16 one-block prompts (so it evicted),
    one read and one prefix match."""
    srv = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port", "0",
                       "--host-mem", "1MiB")  # fmt: skip

    async def traffic() -> None:
        ns = kvclient.Namespace(model="top", revision="r1", num_layers=1, num_kv_heads=2,
                                head_dim=64, dtype=torch.float16)  # fmt: skip
        # 60 s, not 10: a process's first put may compile the codec (kvstore.core.fused),
        # which takes over 10 s on a busy 2-core machine.
        async with await kvclient.KVClient.connect(srv.grpc, ns, timeout_s=60) as kv:
            prompts = [list(range(i * 1000, i * 1000 + 256)) for i in range(16)]
            for i, tokens in enumerate(prompts):
                t = realistic_kv(256, 2, 64, torch.float16, seed=i)
                assert await kv.put_layer(tokens, 0, t) == 256
            assert await kv.match_prefix(prompts[-1]) == 256
            assert (await kv.get_layer(prompts[-1], 0)).shape[1] == 256

    try:
        asyncio.run(traffic())
        yield srv
    finally:
        rc, out = srv.stop()
    assert rc == 0 and "pinned_slots=0" in out, out


def kvctl_process(*argv: str) -> subprocess.Popen[str]:
    """``kvctl argv`` as its own process (the console script's code path)."""
    code = "import sys; from kvctl.main import main; sys.exit(main())"
    return subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_top_once_prints_one_snapshot_of_a_real_pool(pool: Server) -> None:
    metrics = pool.addresses["metrics"]
    proc = kvctl_process("--master", pool.grpc, "top", "--once", "--interval", "0.3",
                         "--metrics", metrics)  # fmt: skip
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (0, ""), err
    lines = out.splitlines()
    assert f" kvstore pool at {pool.grpc}: 1 node (1 live)" in lines[0], lines[0]
    assert "hit ratio 100.0%" in lines[0] and "(last 0.3 s:" in lines[0], lines[0]
    node_row = next(ln for ln in lines if pool.addresses["node"] in ln)
    assert "alive" in node_row and "host" in node_row and "/ 1.0 MiB" in node_row
    metrics_row = next(ln for ln in lines if ln.strip().startswith(metrics))
    assert "tcp 0 B/s" in metrics_row and "host 0.0/s" in metrics_row, metrics_row


async def test_top_once_json_has_totals_and_rates(pool: Server) -> None:
    metrics = pool.addresses["metrics"]
    with dead_port() as port:
        run = await kvctl("--master", pool.grpc, "top", "--once", "--json", "--interval", "0.2",
                          "--metrics", metrics, "--node-metrics-port", str(port))  # fmt: skip
    assert (run.rc, run.err) == (0, "")
    doc = run.json()
    assert list(doc) == ["pool", "interval_s", "hit_ratio", "recent_hit_ratio", "nodes",
                         "tiers", "metrics"]  # fmt: skip
    assert (doc["pool"]["live_nodes"], doc["pool"]["capacity_bytes"]) == (1, 2**20)
    assert doc["interval_s"] >= 0.2 and doc["hit_ratio"] == 1.0
    assert doc["recent_hit_ratio"] is None  # no lookup between the two snapshots
    assert [n["id"] for n in doc["nodes"]] == [pool.addresses["node"]]
    assert [t["name"] for t in doc["tiers"]] == ["host"]
    served, refused = doc["metrics"]
    assert served["endpoint"] == metrics and served["error"] == ""
    moved = {(t["op"], t["transport"]): t for t in served["transfers"]}
    assert set(moved) == {("put", "tcp"), ("get", "tcp")}
    assert moved["put", "tcp"]["bytes"] > 16 * 2 * 256 * 2 * 64 // 2  # 16 INT8 chunks
    assert moved["put", "tcp"]["exchanges"] == 16 and moved["get", "tcp"]["exchanges"] >= 1
    assert moved["put", "tcp"]["bytes_per_s"] == 0.0  # nothing moved between the snapshots
    [evictions] = served["evictions"]
    assert evictions["tier"] == "host" and evictions["total"] >= 1 and evictions["per_s"] == 0
    # The node's data host at the given port: read, refused, reported.
    assert refused["endpoint"] == f"127.0.0.1:{port}"
    assert "refused" in refused["error"].lower() and refused["transfers"] == []


def test_top_refreshes_until_interrupted(pool: Server) -> None:
    proc = kvctl_process("--master", pool.grpc, "top", "--interval", "0.2")
    time.sleep(1.5)  # the import, the first frame and a few refreshes
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert (proc.returncode, err) == (0, ""), err
    assert "kvstore pool at" in out and pool.addresses["node"] in out
    assert "give --metrics HOST:PORT" in out


async def test_a_master_down_among_several_is_passed_over_without_a_word(
    cluster: Cluster,
) -> None:
    """``--master dead,live``: the answer from the live one, nothing on stderr (the
    library's failover warning was printed before the output)."""
    with dead_port() as port:
        proc = kvctl_process("--master", f"127.0.0.1:{port},{cluster.server.address}", "status")
        out, err = await asyncio.to_thread(proc.communicate, timeout=60)
    assert (proc.returncode, err) == (0, "") and "nodes" in out


async def test_top_exit_codes() -> None:
    with dead_port() as port:
        run = await kvctl("--master", f"127.0.0.1:{port}", "--timeout", "2", "top", "--once")
        assert (run.rc, run.out) == (1, "")
        assert run.err == f"kvctl: cannot reach master at 127.0.0.1:{port} {REFUSED}"
        run = await kvctl("--master", f"127.0.0.1:{port}", "top", "--json")
        assert (run.rc, run.err) == (2, "kvctl top: --json needs --once\n")
        run = await kvctl("top", "--interval", "0")
        assert run.rc == 2 and "must be > 0" in run.err


def test_top_reads_a_port_that_does_not_speak_http_as_unreadable() -> None:
    """An endpoint that answers something other than HTTP (an operator who named the gRPC
    port) is a row that says so, not a traceback."""
    from kvctl.top import read_metrics

    with socket.create_server(("127.0.0.1", 0)) as server:

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(4096)
                conn.sendall(b"\x00\x00\x00\x04garbage\r\n\r\n")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        sample = read_metrics(f"127.0.0.1:{server.getsockname()[1]}", 5.0)
        thread.join(5.0)
    assert sample.error, sample


def test_top_imports_neither_torch_nor_numpy(pool: Server) -> None:
    code = (
        "import io, json, sys; from kvctl.main import main; "
        "rc = main(sys.argv[1:], stdout=io.StringIO()); "
        "print(json.dumps([rc, sorted(m for m in ('torch', 'numpy', 'nixl_cu12') "
        "if m in sys.modules)]))"
    )
    argv = ["--master", pool.grpc, "top", "--once", "--json", "--interval", "0.1",
            "--metrics", pool.addresses["metrics"]]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert json.loads(out.stdout) == [0, []], (out.stdout, out.stderr)

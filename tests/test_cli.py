"""``kvstore`` entry points: one-line errors and exit codes, readiness, SIGTERM drain."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
import torch

import kvclient
from kvstore.control.client import MasterClient
from kvstore.control.records import ClusterEvent, ClusterEventKind
from kvstore.core.kvgen import realistic_kv
from kvstore.errors import Unreachable
from tests.cluster import TRANSPORTS, rpc_count, start_server

pytestmark = pytest.mark.slow


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_bad_flag_exits_nonzero_with_one_line() -> None:
    out = _run("serve", "--host-mem", "lots")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "host-mem" in lines[0], out.stderr
    assert out.stdout == ""


def test_unbindable_port_exits_nonzero_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = _run("serve", "--grpc-port", "0", "--data-port", port, "--metrics-port", "0",
                   "--host-mem", "16MiB")  # fmt: skip
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and port in lines[0], out.stderr
    assert "kvstore ready" not in out.stdout


def test_master_on_a_busy_port_prints_one_line_of_ours() -> None:
    """Not gRPC's own ``add_port.cc`` log line first: the port is probed before gRPC binds."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = _run("master", "--grpc-port", port, "--metrics-port", "0")
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.strip().splitlines() if ln]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("kvstore master: error:") and port in lines[0], out.stderr
    assert "--grpc-port" in lines[0] and out.stdout == ""


def test_a_busy_commit_port_prints_one_line_of_ours() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = _run("master", "--grpc-port", "0", "--commit-port", port, "--metrics-port", "0")
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and "--commit-port" in lines[0] and port in lines[0], out.stderr


@pytest.mark.parametrize("commit_port", ["0", "off"])
async def test_a_nodes_commits_go_to_its_masters_commit_port(commit_port: str) -> None:
    """``kvstore master`` names its commit port on its ready line, and a ``kvstore node``'s
    puts commit there (one connection, ``kvstore_commit_links_total``); with
    ``--commit-port off`` the line names none and the same puts commit over gRPC."""
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                          "--commit-port", commit_port)  # fmt: skip
    node = start_server("node", "--master", master.grpc, "--data-port", "0", "--metrics-port",
                        "0", "--host-mem", "32MiB")  # fmt: skip
    ns = kvclient.Namespace(model="commits", revision="r", num_layers=2, num_kv_heads=2,
                            head_dim=64, dtype=torch.float16)  # fmt: skip
    try:
        if commit_port == "off":
            assert "commit" not in master.addresses, master.lines
        else:
            assert master.addresses["commit"].startswith("tcp://127.0.0.1:"), master.lines
        async with await kvclient.KVClient.connect(master.grpc, ns) as kv:
            for i in range(4):
                tokens = list(range(i * 1000, i * 1000 + 512))
                for layer in (0, 1):
                    t = realistic_kv(512, 2, 64, torch.float16, seed=i + layer)
                    assert await kv.put_layer(tokens, layer, t) == 512
                assert await kv.match_prefix(tokens) == 512
        url = f"http://{master.addresses['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        links = re.search(r"^kvstore_commit_links_total (\S+)$", text, re.M)
        assert links is not None and float(links.group(1)) == (commit_port != "off"), text
        assert rpc_count(master, "Commit") >= 8  # (timed as Commit, whichever way in)
    finally:
        rc, out = node.stop()
        master.stop()
    assert rc == 0, out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ready_line_names_every_data_uri(transport: str) -> None:
    server = start_server("serve", "--grpc-port", "0", "--data-port", "0", "--metrics-port",
                          "0", "--host-mem", "16MiB", "--transport", transport)  # fmt: skip
    try:
        assert server.data.startswith("tcp://127.0.0.1:")
        if transport == "ucx":
            assert server.addresses["ucx"].startswith("ucx://127.0.0.1/node-"), server.lines
        else:
            assert "ucx" not in server.addresses
    finally:
        rc, out = server.stop()
    assert rc == 0, out


def test_node_and_master_split_and_sigterm() -> None:
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0")
    node = start_server("node", "--master", master.grpc, "--data-port", "0", "--metrics-port",
                        "0", "--host-mem", "32MiB", "--node-id", "n-split")  # fmt: skip
    assert node.addresses["node"] == "n-split" and node.data.startswith("tcp://127.0.0.1:")
    assert "grpc" in master.addresses and "metrics" in master.addresses
    rc, out = node.stop()
    assert rc == 0 and "pinned_slots=0" in out, out
    rc, out = master.stop()
    assert rc == 0, out


async def test_a_node_started_before_its_master_waits_for_it() -> None:
    """A node whose master is not up yet (started together, or the master restarting)
    waits for it and registers once it answers, instead of exiting."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    node = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "node", "--master", f"127.0.0.1:{port}",
         "--data-port", "0", "--metrics-port", "0", "--host-mem", "32MiB", "--node-id",
         "n-early"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    master = None
    try:
        time.sleep(3.0)  # the node has tried the master and found nobody
        assert node.poll() is None, node.communicate(timeout=5)
        master = start_server("master", "--grpc-port", str(port), "--metrics-port", "0")
        async with MasterClient(master.grpc) as mc:
            deadline = time.monotonic() + 30
            while not await mc.nodes() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            [entry] = await mc.nodes()
        assert entry.node_id == "n-early" and entry.alive
    finally:
        node.terminate()
        out, err = node.communicate(timeout=20)
        if master is not None:
            master.stop()
    assert node.returncode == 0, err
    assert "kvstore ready" in out and "waiting up to" in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_node_waiting_for_its_master_stops_at_once_on_a_signal(sig: signal.Signals) -> None:
    """A node whose master never answers (it waits up to a minute for one) stops within
    seconds of SIGTERM or SIGINT and exits 0. It went on waiting, ~56 s, then exited 1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    node = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "node", "--master", f"127.0.0.1:{port}",
         "--data-port", "0", "--metrics-port", "0", "--host-mem", "32MiB"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        assert node.stderr is not None
        for line in node.stderr:  # (its first wait for the master has begun)
            if "waiting up to" in line or time.monotonic() > deadline:
                break
        node.send_signal(sig)
        t0 = time.monotonic()
        out, _ = node.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if node.poll() is None:
            node.kill()
            node.communicate(timeout=10)
    assert node.returncode == 0 and took < 15, (node.returncode, took)
    assert "kvstore ready" not in out and "kvstore stopped" in out


async def test_a_node_restarted_under_its_id_waits_for_its_old_lease() -> None:
    """kill -9 of a node, restarted at once with the same ``--node-id``: its old
    registration (another process's key) holds the id until its lease ends, so the new
    process registers only then, with a later epoch, and serves."""
    # (a lease longer than a restart takes here, ~3 s: without the binding the new
    # process would take the id over at once, the old epoch dying "re-registered")
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                          "--node-lease-s", "6")  # fmt: skip
    args = ("node", "--master", master.grpc, "--data-port", "0", "--metrics-port", "0",
            "--host-mem", "32MiB", "--node-id", "n-again")  # fmt: skip
    first = start_server(*args)
    try:
        async with MasterClient(master.grpc) as mc:
            [old] = await mc.nodes()
            stream = mc.events(timeout=60)
            await anext(stream)  # (the stream is open: it names its log first)
            first.kill()
            second = start_server(*args)
            [new] = await mc.nodes()
            deaths: list[ClusterEvent] = []
            async for _, events in stream:
                deaths += [e for e in events if e.kind is ClusterEventKind.NODE_DEAD]
                if deaths:
                    break
            await stream.aclose()
        rc, out = second.stop()
        assert rc == 0, out
        assert new.alive and new.epoch > old.epoch and new.data_uri == second.data
        # The old epoch died of its lease, not of the new process taking its id over.
        assert [(d.epoch, d.reason) for d in deaths] == [(old.epoch, "lease expired")]
    finally:
        first.stop()
        master.stop()


async def test_node_reregisters_and_rereports_after_master_restart() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    args = ("master", "--grpc-port", port, "--metrics-port", "0", "--node-lease-s", "1")
    master = start_server(*args)
    node = start_server("node", "--master", master.grpc, "--data-port", "0",
                        "--metrics-port", "0", "--host-mem", "32MiB")  # fmt: skip
    ns = kvclient.Namespace(model="restart", revision="r", num_layers=1, num_kv_heads=2,
                            head_dim=64, dtype=torch.float16)  # fmt: skip
    tokens = list(range(512))
    try:
        async with await kvclient.KVClient.connect(master.grpc, ns) as kv:
            t = realistic_kv(512, 2, 64, torch.float16)
            assert await kv.put_layer(tokens, 0, t) == 512
        master.kill()
        master = start_server(*args)  # a fresh master: an empty index
        async with await kvclient.KVClient.connect(master.grpc, ns) as kv:
            deadline = time.monotonic() + 15
            while await kv.match_prefix(tokens) != 512:  # the node re-registers, re-reports
                assert time.monotonic() < deadline, "node never re-reported its blocks"
                await asyncio.sleep(0.2)
            assert (await kv.get_layer(tokens, 0)).shape[1] == 512
    finally:
        rc, out = node.stop()
        master.stop()
    assert rc == 0, out


@pytest.mark.skipif(not os.environ.get("KVSTORE_TEST_REDIS"), reason="KVSTORE_TEST_REDIS unset")
async def test_master_with_redis_index() -> None:
    """``kvstore master --redis``: a put through one master is found by a match through a
    second master sharing the Redis index."""
    # A database of its own, emptied: nodes left registered by an earlier run would be
    # restored with a grace lease and be placed on.
    url = os.environ["KVSTORE_TEST_REDIS"].rsplit("/", 1)[0] + "/15"
    with redis.Redis.from_url(url, socket_timeout=5) as r:
        r.flushdb()
    masters = [start_server("master", "--grpc-port", "0", "--metrics-port", "0",
                            "--redis", url) for _ in range(2)]  # fmt: skip
    node = start_server("node", "--master", masters[0].grpc, "--data-port", "0",
                        "--metrics-port", "0", "--host-mem", "32MiB")  # fmt: skip
    model = f"redis-{os.getpid()}-{time.time_ns()}"
    ns = kvclient.Namespace(model=model, revision="r", num_layers=1, num_kv_heads=2,
                            head_dim=64, dtype=torch.float16)  # fmt: skip
    tokens = list(range(512))
    try:
        async with await kvclient.KVClient.connect(masters[0].grpc, ns) as kv:
            assert await kv.put_layer(tokens, 0, realistic_kv(512, 2, 64, torch.float16)) == 512
        async with await kvclient.KVClient.connect(masters[1].grpc, ns) as kv:
            assert await kv.match_prefix(tokens) == 512
            assert (await kv.get_layer(tokens, 0)).shape[1] == 512
    finally:
        rc, out = node.stop()
        for m in masters:
            m.stop()
    assert rc == 0, out


@pytest.mark.skipif(not os.environ.get("KVSTORE_TEST_REDIS"), reason="KVSTORE_TEST_REDIS unset")
async def test_two_masters_on_one_redis_keep_each_others_nodes_alive() -> None:
    """Leases live in Redis: a node heartbeating to one master stays alive (not suspect,
    not expired) on the other, lease period after lease period, and a match through either
    master finds its blocks throughout. The second master starts after the node registered,
    so it knows the node from the store (as after a restart), not from a registration."""
    url = os.environ["KVSTORE_TEST_REDIS"].rsplit("/", 1)[0] + "/14"
    with redis.Redis.from_url(url, socket_timeout=5) as r:
        r.flushdb()
    lease = 2.0
    flags = (
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        "--redis",
        url,
        "--node-lease-s",
        str(lease),
    )
    masters = [start_server("master", *flags)]
    node = start_server("node", "--master", masters[0].grpc, "--data-port", "0",
                        "--metrics-port", "0", "--host-mem", "32MiB")  # fmt: skip
    masters.append(start_server("master", *flags))  # restores the node from Redis
    ns = kvclient.Namespace(model=f"leases-{time.time_ns()}", revision="r", num_layers=1,
                            num_kv_heads=2, head_dim=64, dtype=torch.float16)  # fmt: skip
    tokens = list(range(512))
    try:
        async with await kvclient.KVClient.connect(masters[0].grpc, ns) as kv:
            assert await kv.put_layer(tokens, 0, realistic_kv(512, 2, 64, torch.float16)) == 512
        clients = [await kvclient.KVClient.connect(m.grpc, ns) for m in masters]
        try:
            end = time.monotonic() + 3 * lease + 1
            while time.monotonic() < end:  # bounded: three lease periods
                for kv in clients:
                    assert await kv.match_prefix(tokens) == 512
                async with MasterClient(masters[1].grpc, timeout_s=5) as other:
                    (info,) = await other.nodes()
                assert info.alive and not info.suspect, info
                await asyncio.sleep(0.5)
        finally:
            for kv in clients:
                await kv.close()
    finally:
        rc, out = node.stop()
        for m in masters:
            m.stop()
    assert rc == 0, out


@pytest.mark.skipif(not os.environ.get("KVSTORE_TEST_REDIS"), reason="KVSTORE_TEST_REDIS unset")
async def test_kill_9_of_a_master_and_nodes_and_clients_go_on_through_the_other() -> None:
    """Masters on one Redis, a node and a client naming both: after ``kill -9`` of the one
    they used, the client's calls and the node's heartbeats and commits go to the other,
    under the same epoch (nothing re-registered, nothing lost)."""
    url = os.environ["KVSTORE_TEST_REDIS"].rsplit("/", 1)[0] + "/13"
    with redis.Redis.from_url(url, socket_timeout=5) as r:
        r.flushdb()
    lease = 2.0
    flags = ("--grpc-port", "0", "--metrics-port", "0", "--redis", url,
             "--node-lease-s", str(lease))  # fmt: skip
    masters = [start_server("master", *flags) for _ in range(2)]
    both = ",".join(m.grpc for m in masters)
    node = start_server("node", "--master", both, "--data-port", "0", "--metrics-port", "0",
                        "--host-mem", "32MiB")  # fmt: skip
    ns = kvclient.Namespace(model=f"failover-{time.time_ns()}", revision="r", num_layers=1,
                            num_kv_heads=2, head_dim=64, dtype=torch.float16)  # fmt: skip
    first, second = list(range(512)), list(range(1000, 1512))
    try:
        kv = await kvclient.KVClient.connect([m.grpc for m in masters], ns, timeout_s=5)
        async with kv:
            assert await kv.put_layer(first, 0, realistic_kv(512, 2, 64, torch.float16)) == 512
            async with MasterClient(masters[1].grpc, timeout_s=5) as other:
                (before,) = await other.nodes()
            masters[0].kill()
            assert await kv.match_prefix(first) == 512  # through the other master
            end = time.monotonic() + 2 * lease + 1
            while time.monotonic() < end:  # bounded: two lease periods on the survivor
                assert await kv.match_prefix(first) == 512
                await asyncio.sleep(0.5)
            async with MasterClient(masters[1].grpc, timeout_s=5) as other:
                (after,) = await other.nodes()
            assert after.alive and not after.suspect and after.epoch == before.epoch, after
            put = await kv.put_layer(second, 0, realistic_kv(512, 2, 64, torch.float16, seed=1))
            assert put == 512 and await kv.match_prefix(second) == 512  # commits reach it
            assert (await kv.get_layer(first, 0)).shape[1] == 512
    finally:
        rc, out = node.stop()
        for m in masters:
            m.stop()
    assert rc == 0, out


@pytest.mark.skipif(not os.environ.get("KVSTORE_TEST_REDIS"), reason="KVSTORE_TEST_REDIS unset")
async def test_a_flushed_redis_is_rebuilt_from_the_nodes_within_a_lease() -> None:
    """Redis loses everything (FLUSHDB): the node's next heartbeat is refused, it registers
    again and re-reports every block it holds, so the index is back within a lease + 2 s."""
    url = os.environ["KVSTORE_TEST_REDIS"].rsplit("/", 1)[0] + "/12"
    with redis.Redis.from_url(url, socket_timeout=5) as r:
        r.flushdb()
    lease = 2.0
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0", "--redis", url,
                          "--node-lease-s", str(lease))  # fmt: skip
    node = start_server("node", "--master", master.grpc, "--data-port", "0",
                        "--metrics-port", "0", "--host-mem", "32MiB")  # fmt: skip
    ns = kvclient.Namespace(model=f"flushed-{time.time_ns()}", revision="r", num_layers=1,
                            num_kv_heads=2, head_dim=64, dtype=torch.float16)  # fmt: skip
    prompts = [list(range(k * 1000, k * 1000 + 512)) for k in range(3)]
    try:
        async with await kvclient.KVClient.connect(master.grpc, ns) as kv:
            for k, tokens in enumerate(prompts):
                t = realistic_kv(512, 2, 64, torch.float16, seed=k)
                assert await kv.put_layer(tokens, 0, t) == 512
            with redis.Redis.from_url(url, socket_timeout=5) as r:
                r.flushdb()
            assert await kv.match_prefix(prompts[0]) == 0  # the index is gone
            deadline = time.monotonic() + lease + 2
            while [await kv.match_prefix(p) for p in prompts] != [512] * 3:
                assert time.monotonic() < deadline, "the index was not rebuilt in time"
                await asyncio.sleep(0.1)
            assert (await kv.get_layer(prompts[2], 0)).shape[1] == 512
    finally:
        rc, out = node.stop()
        master.stop()
    assert rc == 0, out


def test_clients_and_nodes_load_none_of_the_masters_modules() -> None:
    """The control-plane contract is its own package: importing kvclient, kvctl, the vLLM
    connector or a storage node loads the master client but none of the master's server,
    service, index, membership or watch modules."""
    code = (
        "import sys, kvclient, kvctl.main, kvclient.vllm_connector, kvstore.node.server\n"
        "import kvstore.control.client\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvstore.master')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_a_master_whose_redis_is_down_logs_one_traceback_not_one_a_second() -> None:
    """Redis stopped under a master: its lease sweep fails every second; the traceback is
    logged once (it was logged at every sweep, ~74 lines a second), and a caller gets
    Unreachable (it got TransportError, gRPC's INTERNAL)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    master = None
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.1)
        master = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "master", "--grpc-port", "0",
             "--metrics-port", "0", "--redis", f"redis://127.0.0.1:{port}/0",
             "--node-lease-s", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert master.stdout is not None
        ready = master.stdout.readline()
        assert "kvstore ready" in ready
        grpc_at = dict(re.findall(r"(\w+)=(\S+)", ready))["grpc"]
        store.kill()
        store.wait(10)
        time.sleep(5.0)  # (sweeps every lease/3 s or so: several of them failed)

        async def ask() -> None:  # a caller is told the index is out of reach (not INTERNAL)
            async with MasterClient(grpc_at, timeout_s=10) as mc:
                await mc.nodes()

        with pytest.raises(Unreachable, match="redis"):
            asyncio.run(ask())
        run = subprocess.run([str(Path(sys.executable).with_name("kvctl")), "--master", grpc_at,
                              "--timeout", "5", "status"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert run.returncode == 1 and "the master answered: redis at" in run.stderr, run.stderr
        master.terminate()
        _, err = master.communicate(timeout=30)
    finally:
        for proc in (store, master):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    assert err.count("lease sweep failed") == 1, err[-3000:]
    assert err.count("ERROR") == 1, err[-3000:]  # (no other line of the sweep's since)
    assert "Traceback" not in err and "unreachable" in err, err[-3000:]  # (one line of ours)

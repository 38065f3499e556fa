"""The disk tier under faults: a file system that fills up (a 2 MiB tmpfs), one that turns
read-only under the node (ext4 on a loop device, forced read-only), EIO at the system-call
boundary (``tests/faults/faultshim.c`` preloaded into a real node process), and a segment
deleted underneath the node. In each the fault is counted and the node goes on serving:
every chunk it serves is the one that was put, and the master's index claims nothing the
node cannot serve."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvclient
from kvstore.node.disk_tier import DiskTier
from tests.cluster import start_server
from tests.test_disk import (
    KV_NS,
    _disk_stats,
    _node,
    _put_all,
    _put_prompts,
    _read_all,
    disk_node,
)
from tests.test_node import TIMEOUT, Rig, blocks

SHIM = Path(__file__).parent / "faults" / "faultshim.c"


def _sh(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


@contextlib.contextmanager
def _mounted(mnt: Path, *argv: str) -> Iterator[Path]:
    """``mount ARGV MNT`` for the ``with`` body (skips the test where mounting is refused)."""
    mnt.mkdir(parents=True, exist_ok=True)
    done = _sh("mount", *argv, str(mnt))
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        _sh("umount", "-l", str(mnt))


def _errors(tier: DiskTier, op: str, reason: str) -> float:
    return tier.metrics.disk_errors.labels(op=op, reason=reason)._value.get()


Sent = dict[tuple[bytes, int], torch.Tensor]


async def _consistent(rig: Rig, keys: list[bytes], sent: Sent) -> int:
    """Every chunk the node serves is the one put, and every block the index still claims
    after the reads was served whole; how many blocks it served. (Reads stage blocks up
    from disk, which evicts others: those evictions reach the index with the next commit.)"""
    got = await _read_all(rig, keys)
    assert all(torch.equal(got[k], sent[k]) for k in got)
    served = [sum((k, layer) in got for layer in (0, 1)) for k in keys]
    await rig.node.link.commit([])
    claimed = await rig.holders(keys)
    assert all(s == 2 for s, c in zip(served, claimed, strict=True) if c), (served, claimed)
    return sum(n == 2 for n in served)


async def test_a_full_file_system_shrinks_the_tier_and_loses_no_block_it_claims(
    tmp_path: Path,
) -> None:
    with _mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=4m", "tmpfs") as mnt:
        async with disk_node(mnt / "disk") as (rig, tier):
            keys = blocks(40)  # 10 MiB of blocks, 4 MiB of memory, 4 MiB of file system
            sent: Sent = {}
            for i in range(0, 40, 8):
                sent |= await _put_all(rig, keys[i : i + 8])
                await tier.flush(TIMEOUT)
            assert _errors(tier, "write", "ENOSPC") >= 1
            assert tier.store.capacity <= 4 * 2**20 and tier.writing
            assert tier.counters["written"] > 8  # it went on writing after it shrank
            assert len(tier.store) >= 4 and tier.store.used_bytes <= tier.store.capacity
            assert await _consistent(rig, keys, sent) >= 8


async def test_a_file_system_turned_read_only_stops_writes_and_keeps_serving(
    tmp_path: Path,
) -> None:
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("no mkfs.ext4")
    image = tmp_path / "fs.img"
    with open(image, "wb") as f:
        f.truncate(64 * 2**20)
    assert _sh("mkfs.ext4", "-q", "-F", str(image)).returncode == 0
    with _mounted(tmp_path / "ro", "-o", "loop,errors=remount-ro", str(image)) as mnt:
        source = _sh("findmnt", "-no", "SOURCE", str(mnt)).stdout.strip()
        trigger = Path("/sys/fs/ext4") / Path(source).name / "trigger_fs_error"
        if not trigger.exists():
            pytest.skip(f"no {trigger}")
        async with disk_node(mnt / "disk", 48 * 2**20) as (rig, tier):
            keys = blocks(48)
            sent: Sent = {}
            for i in range(0, 24, 8):  # (the writer keeps up: nothing leaves memory unwritten)
                sent |= await _put_all(rig, keys[i : i + 8])
                assert await tier.flush(TIMEOUT)
            assert tier.counters["written"] == 24
            trigger.write_text("kvstore test\n")  # ext4 remounts itself read-only
            sent |= await _put_all(rig, keys[24:])  # puts go on, into memory
            await tier.flush(TIMEOUT)
            assert _errors(tier, "write", "EROFS") >= 1 and not tier.writing
            assert "EROFS" in tier.stats()["fault"]
            # The 24 blocks written before are read back from the read-only disk.
            assert await _consistent(rig, keys, sent) >= 24


async def test_a_segment_deleted_underneath_is_dropped_not_served(tmp_path: Path) -> None:
    async with disk_node(tmp_path / "disk", 16 * 2**20) as (rig, tier):
        keys = blocks(48)
        sent = await _put_all(rig, keys)
        assert await tier.flush(TIMEOUT)
        first = min((tmp_path / "disk").glob("seg-*.kvd"))
        first.unlink()
        tier.check()
        assert _errors(tier, "check", "deleted") == 1
        served = await _consistent(rig, keys, sent)
        assert 8 <= served < 48


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("no gcc for the fault shim")
    out = tmp_path_factory.mktemp("shim") / "faultshim.so"
    built = _sh("gcc", "-O2", "-Wall", "-shared", "-fPIC", "-o", str(out), str(SHIM), "-ldl")
    assert built.returncode == 0, built.stderr
    return out


async def test_eio_on_the_disk_loses_no_byte_and_the_node_serves_on(
    tmp_path: Path, shim: Path
) -> None:
    """A real node process whose segment reads and writes fail with EIO once a control
    file exists: reads of blocks only on disk become misses (never wrong bytes), the index
    stops claiming them, puts go on, and the node counts the fault."""
    ctl = tmp_path / "faults-on"
    env = {"LD_PRELOAD": str(shim), "FAULT_PATH": f"{tmp_path}/disk/seg-*",
           "FAULT_CTL": str(ctl), "FAULT_ERRNO": "5"}  # fmt: skip
    master = start_server("master", "--grpc-port", "0", "--metrics-port", "0")
    node = start_server(*_node(master.grpc, tmp_path / "disk"), env=env)
    try:
        async with await kvclient.KVClient.connect(master.grpc, KV_NS, timeout_s=TIMEOUT) as c:
            prompts, _ = await _put_prompts(c, node.data, 30)
            want = [await c.get_layer(t, 2) for t in prompts]
            ctl.write_text("on")
            for p in range(10):  # puts go on, in memory
                tokens = [(30000 + p * 7919 + t) % 60000 for t in range(256)]
                for layer in range(4):
                    assert (
                        await c.put_layer(tokens, layer, torch.randn(2, 256, 4, 64).bfloat16())
                        == 256
                    )
            short = 0
            for p, tokens in enumerate(prompts):
                got = await c.get_layer(tokens, 2)
                n = got.shape[1]
                short += n < 256
                assert torch.equal(got, want[p][:, :n])  # a prefix, never a wrong byte
            assert short >= 10  # most of them were only on disk
            d = await _disk_stats(node.data)
            assert d["errors"] >= 1 and "EIO" in d["fault"]
            ctl.unlink()
            # The index stops claiming them with the node's next commit (a sweep: 0.5 s).
            for _ in range(50):
                claimed = [await c.match_prefix(t) for t in prompts]
                if sum(n < 256 for n in claimed) >= short:
                    break
                await asyncio.sleep(0.1)
            for p, tokens in enumerate(prompts):
                got = await c.get_layer(tokens, 2)
                assert got.shape[1] >= claimed[p] and torch.equal(got, want[p][:, : got.shape[1]])
    finally:
        node.stop()
        master.stop()

"""``kill -9`` torture of a node's disk tier: a master and one node with a small host memory
and a disk tier; loop after loop, prompts are put while the node is killed with SIGKILL at
a random moment, the node is restarted on the same ``--disk-path`` (the same command line),
and every acknowledged block that was on its disk before the kill is read back and compared
byte for byte with what was put.

    python bench/disk_torture.py [--loops 50] [--writers 3] [--prompts-per-writer 2]
                                 [--settled-prompts 2] [--host-mem 8MiB] [--disk-size 256MiB]
                                 [--lease-s 2] [--jitter-ms 20] [--seed 1] [--dir DIR]
                                 [--plot PATH] [--json PATH]

Everything runs on this machine: ``kvstore master --node-lease-s 2`` and ``kvstore node
--host-mem 8MiB --disk-path DIR --disk-size 256MiB --log-level INFO`` (every port 0, no node
id: a restarted node takes the id its disk was written by), the client tasks in this
process. Prompts of 256 tokens (4 blocks of 64), 4 layers, 2 KV heads of 64, bf16,
``quant="none"``: a read must return the very bytes written (128 KiB a block).

Each loop:

1. **Settled batch.** ``--settled-prompts`` new prompts are put, layer after layer, with no
   other put in flight. A block is *acknowledged* when ``put_layer`` of every layer
   returned at least its last token. Then the node's stats are polled (bounded) until its
   disk tier has ``queued == 0`` and ``written`` advanced by the batch's block count.
2. **In-flight batch and the kill.** ``--writers`` asyncio tasks each put
   ``--prompts-per-writer`` new prompts layer after layer, concurrently. Once a random
   number of layer puts (0 to all but one) has been acknowledged, the node's stats and the
   master's ``Lookup`` of every block of the on-disk set (below) are taken, the writers
   still putting; then the node gets SIGKILL, in half the loops at once on the next
   acknowledgement of a prompt's last layer (its blocks have just completed: queued for
   the disk or being written), in the other half a random 0..``--jitter-ms`` after the
   next acknowledgement of any layer. The writers record whatever acknowledgements still
   arrive, then stop at their first error.
3. **Restart** on the same directory with the same command line; the time from the kill
   to its ready line (which includes the wait for its old lease, ``--lease-s``), and from
   its log the blocks it adopted, the time its disk took to open and the torn bytes it
   dropped (few if any: the tier writes each batch with one ``pwrite``, so a SIGKILL
   tears a tail only when it cuts that call short).
4. **Read back** (``get_layer`` of every layer, ``match_prefix``, ``Lookup``, and the
   holder's data port for every block ``Lookup`` claims) every prompt with a block in the
   checked set, and every prompt of the in-flight batch.

**On disk before the kill** means: a block that

- (a) was acknowledged, in a settled batch whose wait ended with the disk tier's counters
  proving each of its blocks written — ``written`` and ``slots`` each advanced by exactly
  the batch's block count and ``unwritten_evictions``, ``skipped`` and ``errors`` did not
  move (no other put was in flight; a block is queued once, when its last chunk lands, and
  a record is never rewritten while its mask is unchanged) — a batch whose counters do not
  add up is *unproven* and left out; or
- (b) was read back intact after an earlier restart, whether its ack came or was lost in
  the kill (the kill emptied host memory: what the restarted node serves came from its
  disk);

and that the master's ``Lookup`` taken just before the kill listed the node as holding
every chunk of. Those blocks are the loop's **checked** blocks. One of them that ``Lookup``
no longer listed before the kill (the node let go of it while running, the disk being far
from full) is counted *vanished*.

After the restart a checked block is **lost** if some layer's ``get_layer`` does not
return it (reads return the leading run of present blocks: a block after a lost one is
lost too), **corrupt** if the bytes returned for it differ from what was put. A
**phantom** is a block ``Lookup`` lists a holder of every chunk for whose holder's data
port does not return all its chunks, a block within ``match_prefix``'s answer that some
``get_layer`` does not return, or a block served that was never acknowledged and whose
bytes differ from what was put. Beside them, allowed: **memory-only lost**, acknowledged
blocks of the in-flight batch not yet on disk and gone after the restart (an
acknowledgement promises memory, not disk); in-flight blocks served intact after the
restart (they reached the disk before the kill) join the on-disk set, acknowledged or not
(*unacked kept*: stored, the ack lost in the kill).

The disk is never left to fill (the run refuses a ``--loops`` whose worst case exceeds 90 %
of ``--disk-size``), so no block may leave it: checked sets grow loop after loop and a
block of loop 1 is read back after every restart. Markdown on stdout, progress on stderr,
a PNG of blocks checked and restart time per loop with ``--plot``, every figure as JSON
with ``--json``. The exit status is 1 when any block was corrupt, phantom, lost or
vanished.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients"))

import torch

import kvclient
from bench._common import (
    BarPanel,
    Serve,
    Table,
    explain,
    percentile,
    print_report,
    progress,
    save_bar_plot,
    seeded_kv,
    seeded_tokens,
)
from kvstore.control.client import MasterClient
from kvstore.core.codec import chunk_nbytes
from kvstore.core.sizes import parse_size
from kvstore.dataplane import NodeClient
from kvstore.dataplane.messages import ChunkRef
from kvstore.errors import KVStoreError

TOKENS, BLOCK, HEADS, HEAD_DIM, LAYERS = 256, 64, 2, 64, 4
BLOCKS = TOKENS // BLOCK
NS = kvclient.Namespace(model="disk-torture", revision="1", num_layers=LAYERS,
                        num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16,
                        block_tokens=BLOCK, quant="none")  # fmt: skip
CHUNK_BYTES = chunk_nbytes(BLOCK, HEADS, HEAD_DIM, torch.bfloat16, "none")
RECORD_BYTES = -(-(4096 + LAYERS * CHUNK_BYTES) // 4096) * 4096
"""A block's disk record at most (header page, payload, alignment)."""
OP_TIMEOUT_S = 10.0
SETTLE_TIMEOUT_S = 60.0
START_TRIES = 3
"""Starts of the node tried after a kill (one that exits before its ready line is
counted and reported, e.g. its master too slow to answer on a loaded machine)."""
LOOKUP_BATCH = 256
ADOPTED = re.compile(
    r"(\d+) blocks in (\d+) segments adopted in ([\d.]+) s \(O_DIRECT (\w+), (\d+) torn"
)
TORN = re.compile(r"dropped (\d+) bytes of torn tail from (\S+)")

Key = tuple[int, int]
"""A block: (prompt seed, block index)."""


def kv_of(seed: int, layer: int) -> torch.Tensor:
    """The KV put for ``(seed, layer)``: ``[2, TOKENS, HEADS, HEAD_DIM]`` bf16."""
    return seeded_kv(seed, layer, TOKENS, HEADS, HEAD_DIM)


def tokens_of(seed: int) -> list[int]:
    return seeded_tokens(seed, TOKENS)


@dataclass
class Prompt:
    seed: int
    loop: int
    batch: str
    """``settled`` or ``inflight``."""
    tokens: list[int]
    hashes: list[bytes]
    acked: list[int] = field(default_factory=lambda: [0] * LAYERS)
    """Tokens each layer's ``put_layer`` acknowledged."""
    acked_at: float = 0.0
    """Monotonic time the last of its layers was acknowledged."""

    @classmethod
    def new(cls, seed: int, loop: int, batch: str) -> Prompt:
        tokens = tokens_of(seed)
        return cls(seed, loop, batch, tokens, kvclient.block_hashes(NS, tokens))

    @property
    def acked_blocks(self) -> int:
        """Leading blocks acknowledged for every layer (``put_layer`` answers a prefix)."""
        return min(self.acked) // BLOCK


@dataclass
class Readback:
    """One prompt read back after a restart, per block."""

    served: list[bool]
    """Every layer's ``get_layer`` returned it."""
    wrong: list[bool]
    """Some layer returned bytes for it that differ from what was put."""
    phantom: list[bool]


@dataclass
class LoopResult:
    loop: int
    checked: int = 0
    corrupt: int = 0
    phantom: int = 0
    lost: int = 0
    vanished: int = 0
    memory_only_lost: int = 0
    survived: int = 0
    unacked_kept: int = 0
    inflight_acked: int = 0
    unproven: int = 0
    put_errors_before_kill: int = 0
    layer_puts_before_kill: int = 0
    layer_puts_planned: int = 0
    queued_at_kill: int = 0
    """Blocks queued for the disk one layer put before the kill."""
    complete_at_kill: int = 0
    memory_only_age_ms: float | None = None
    """The oldest memory-only loss: from its last layer's ack to the kill (negative: the
    ack came after the kill was sent)."""
    kill_on: str = ""
    """``complete``: right at a prompt's last-layer ack; ``any``: after any ack, jittered."""
    kill_after_ack_ms: float = 0.0
    """From the last layer put acknowledged to the SIGKILL."""
    ack_gap_ms: float = 0.0
    """Mean time between layer put acknowledgements before the kill."""
    """In-flight blocks acknowledged (every layer) when the kill was sent."""
    disk_slots_at_kill: int = 0
    restart_s: float = 0.0
    failed_starts: int = 0
    disk_open_s: float = 0.0
    adopted: int = 0
    torn_bytes: int = 0
    log_errors: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)


class Rig:
    """The master, the node (restartable on its disk) and their logs."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.disk = root / "disk"
        self.master: Serve | None = None
        self.node: Serve | None = None

    def start_master(self) -> None:
        self.master = Serve.start(
            "--grpc-port", "0", "--metrics-port", "0", "--node-lease-s", str(self.args.lease_s),
            "--log-level", "WARNING", command="master",
        )  # fmt: skip

    @property
    def master_addr(self) -> str:
        assert self.master is not None
        return self.master.addresses["grpc"]

    @property
    def node_uri(self) -> str:
        assert self.node is not None
        return self.node.addresses["data"]

    def node_flags(self) -> list[str]:
        a = self.args
        return ["--master", self.master_addr, "--data-port", "0", "--metrics-port", "0",
                "--host-mem", a.host_mem, "--disk-path", str(self.disk),
                "--disk-size", a.disk_size, "--log-level", "INFO"]  # fmt: skip

    def start_node(self) -> str:
        """Start the node (same command line every time); its log so far."""
        self.node = Serve.start(*self.node_flags(), command="node", timeout=90)
        return self.log()

    def log(self) -> str:
        node = self.node
        if node is None or node.stderr.closed:
            return ""
        node.stderr.seek(0)
        return node.stderr.read()

    def kill_node(self) -> str:
        """SIGKILL the node, reap it; everything it logged."""
        node = self.node
        assert node is not None
        if node.proc.poll() is None:
            node.proc.kill()
        node.proc.wait(10)
        text = self.log()
        node.stderr.close()
        if node.proc.stdout is not None:
            node.proc.stdout.close()
        self.node = None
        return text

    def stop(self) -> None:
        for srv in (self.node, self.master):
            if srv is not None and srv.proc.poll() is None:
                with contextlib.suppress(Exception):
                    srv.stop(timeout=20)
            elif srv is not None and not srv.stderr.closed:
                srv.stderr.close()


# ---- client-side helpers ------------------------------------------------------------------


async def client(rig: Rig) -> kvclient.KVClient:
    """A client of the master, retried for up to 30 s."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await kvclient.KVClient.connect(
                rig.master_addr, NS, timeout_s=OP_TIMEOUT_S, ucx=False
            )
        except KVStoreError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def disk_stats(uri: str) -> dict[str, Any]:
    stats = await asyncio.wait_for(NodeClient(uri, timeout_s=5).stats(), 10)
    (disk,) = [t for t in stats["tiers"] if t["name"] == "disk"]
    return dict(disk)


async def lookup(master: MasterClient, prompts: list[Prompt]) -> dict[Key, list[Any]]:
    """The master's live holders of every block of ``prompts`` that hold all its chunks."""
    keys = [(p.seed, i) for p in prompts for i in range(BLOCKS)]
    hashes = [p.hashes[i] for p in prompts for i in range(BLOCKS)]
    out: dict[Key, list[Any]] = {}
    for at in range(0, len(keys), LOOKUP_BATCH):
        part = hashes[at : at + LOOKUP_BATCH]
        answer = await asyncio.wait_for(master.lookup(NS.id, part, LAYERS), OP_TIMEOUT_S)
        for key, holders in zip(keys[at : at + LOOKUP_BATCH], answer, strict=True):
            out[key] = [h for h in holders if all(h.has(c) for c in range(LAYERS))]
    return out


async def put_prompt(kv: kvclient.KVClient, p: Prompt, tries: int = 1) -> int:
    """Put every layer of ``p`` (each tried up to ``tries`` times); the errors raised."""
    errors = 0
    for layer in range(LAYERS):
        t = kv_of(p.seed, layer)
        for attempt in range(tries):
            try:
                p.acked[layer] = await kv.put_layer(p.tokens, layer, t)
                break
            except KVStoreError:
                errors += 1
                if attempt + 1 < tries:
                    await asyncio.sleep(0.5)
    return errors


async def present_at(uri: str, blocks: list[bytes]) -> list[bool]:
    """Per block of ``blocks``: whether the data port at ``uri`` returns its every chunk."""
    refs = [ChunkRef(b, c) for b in blocks for c in range(LAYERS)]
    try:
        found = await asyncio.wait_for(
            NodeClient(uri, timeout_s=5).get(
                NS.id, refs, lambda found: [bytearray(CHUNK_BYTES) for _ in found]
            ),
            10,
        )
    except (KVStoreError, OSError, TimeoutError):
        return [False] * len(blocks)
    have = set(found)
    return [all(i * LAYERS + c in have for c in range(LAYERS)) for i in range(len(blocks))]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


async def read_back(kv: kvclient.KVClient, p: Prompt, holders: dict[Key, list[Any]]) -> Readback:
    served = [True] * BLOCKS
    wrong = [False] * BLOCKS
    for layer in range(LAYERS):
        got = await kv.get_layer(p.tokens, layer)
        n = got.shape[1] // BLOCK
        want = kv_of(p.seed, layer)
        for i in range(BLOCKS):
            if i >= n:
                served[i] = False
                continue
            span = slice(i * BLOCK, (i + 1) * BLOCK)
            if not same_bits(got[:, span], want[:, span]):
                wrong[i] = True
    matched = await kv.match_prefix(p.tokens) // BLOCK
    phantom = [False] * BLOCKS
    claimed: dict[str, list[int]] = {}
    for i in range(BLOCKS):
        for h in holders.get((p.seed, i), []):
            claimed.setdefault(h.data_uri, []).append(i)
    for uri, idx in claimed.items():
        there = await present_at(uri, [p.hashes[i] for i in idx])
        for i, ok in zip(idx, there, strict=True):
            phantom[i] |= not ok
    for i in range(BLOCKS):
        if i < matched and not served[i]:
            phantom[i] = True
        if served[i] and wrong[i] and i >= p.acked_blocks:
            phantom[i] = True  # served, never acknowledged, other bytes
    return Readback(served, wrong, phantom)


# ---- one loop -------------------------------------------------------------------------------


class Torture:
    def __init__(self, args: argparse.Namespace, rig: Rig) -> None:
        self.args = args
        self.rig = rig
        self.rng = random.Random(args.seed)
        self.prompts: dict[int, Prompt] = {}
        self.on_disk: dict[Key, int] = {}
        """Blocks on disk (see the module docstring), with the loop that first proved it."""
        self.node_id = ""
        self.results: list[LoopResult] = []

    def fresh(self, loop: int, index: int, batch: str) -> Prompt:
        p = Prompt.new(self.args.seed * 10_000_000 + loop * 1000 + index, loop, batch)
        self.prompts[p.seed] = p
        return p

    async def settled_batch(self, loop: int, res: LoopResult) -> None:
        """Put the settled batch; prove it written (or count it unproven)."""
        rig = self.rig
        async with await client(rig) as kv:
            s0 = await disk_stats(rig.node_uri)
            batch = [self.fresh(loop, j, "settled") for j in range(self.args.settled_prompts)]
            errors = 0
            for p in batch:
                errors += await put_prompt(kv, p, tries=3)
        acked = sum(p.acked_blocks for p in batch)
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            s1 = await disk_stats(rig.node_uri)
            if s1["queued"] == 0 and s1["written"] - s0["written"] >= acked:
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        moved = {k: s1[k] - s0[k] for k in ("written", "slots", "unwritten_evictions",
                                            "skipped", "errors")}  # fmt: skip
        full = all(p.acked_blocks == BLOCKS for p in batch)
        quiet = not (moved["unwritten_evictions"] or moved["skipped"] or moved["errors"])
        exact = moved["written"] == acked and moved["slots"] == acked
        proven = not errors and full and exact and quiet
        if proven:
            for p in batch:
                for i in range(BLOCKS):
                    self.on_disk.setdefault((p.seed, i), loop)
        else:
            res.unproven += len(batch) * BLOCKS
            res.details.append(f"settled batch unproven: put errors {errors}, moved {moved}")

    async def inflight_and_kill(self, loop: int, res: LoopResult) -> tuple[list[Prompt], float]:
        """Writers put the in-flight batch; the node is killed at a random moment. Returns
        the batch and the monotonic time of the kill; fills in the checked set."""
        args, rig, rng = self.args, self.rig, self.rng
        batch = [
            [self.fresh(loop, 100 + w * 10 + j, "inflight") for j in range(args.prompts_per_writer)]
            for w in range(args.writers)
        ]
        planned = args.writers * args.prompts_per_writer * LAYERS
        look_after = rng.randrange(planned)
        # Half the kills go right after a prompt's last layer is acknowledged (its blocks
        # just complete: queued for the disk or being written), half at a random moment.
        on_complete = rng.random() < 0.5
        jitter = 0.0 if on_complete else rng.uniform(0, args.jitter_ms / 1000)
        res.layer_puts_planned = planned
        res.kill_on = "complete" if on_complete else "any"
        acked_puts = 0
        armed = False
        ack_times: list[float] = []
        killed = asyncio.Event()
        look = asyncio.Event()  # set at the kill point: take the snapshot
        trigger = asyncio.Event()  # set on each ack (each last-layer ack) after it
        if look_after == 0:
            look.set()

        async def writer(kv: kvclient.KVClient, prompts: list[Prompt]) -> None:
            nonlocal acked_puts
            for p in prompts:
                for layer in range(LAYERS):
                    try:
                        p.acked[layer] = await kv.put_layer(p.tokens, layer, kv_of(p.seed, layer))
                        p.acked_at = time.monotonic()
                    except Exception:  # the node is gone (or a fault: counted)
                        if not killed.is_set():
                            res.put_errors_before_kill += 1
                        return
                    if not killed.is_set():
                        acked_puts += 1
                        ack_times.append(time.monotonic())
                        if acked_puts >= look_after:
                            look.set()
                        if armed and (not on_complete or layer == LAYERS - 1):
                            trigger.set()

        async def until(event: asyncio.Event, everyone: asyncio.Future[Any]) -> None:
            wait = asyncio.create_task(event.wait())
            await asyncio.wait([wait, everyone], timeout=60, return_when=asyncio.FIRST_COMPLETED)
            wait.cancel()

        master = MasterClient(rig.master_addr, timeout_s=OP_TIMEOUT_S)
        kv = await client(rig)
        try:
            t_start = time.monotonic()
            tasks = [asyncio.create_task(writer(kv, ps)) for ps in batch]
            everyone = asyncio.gather(*tasks, return_exceptions=True)
            await until(look, everyone)
            # Shortly before the kill (one layer put before it, the writers still putting):
            # the node's disk and the master's Lookup.
            stats, held = await asyncio.gather(
                disk_stats(rig.node_uri),
                lookup(master, [self.prompts[s] for s in sorted({s for s, _ in self.on_disk})]),
            )
            armed = True  # the kill comes at the next ack (last-layer ack) from here on
            await until(trigger, everyone)
            if jitter:
                await asyncio.sleep(jitter)
            assert rig.node is not None
            rig.node.proc.kill()
            t_kill = self.t_kill = time.monotonic()
            res.kill_after_ack_ms = (t_kill - max(ack_times, default=t_start)) * 1000
            res.ack_gap_ms = (
                (max(ack_times, default=t_start) - t_start) * 1000 / max(1, len(ack_times))
            )
            killed.set()
            res.layer_puts_before_kill = acked_puts
            res.queued_at_kill = stats["queued"]
            res.disk_slots_at_kill = stats["slots"]
            res.complete_at_kill = sum(p.acked_blocks for ps in batch for p in ps)
            checked = set()
            for key in list(self.on_disk):
                if any(h.node_id == self.node_id for h in held.get(key, [])):
                    checked.add(key)
                else:
                    res.vanished += 1
                    del self.on_disk[key]
                    res.details.append(f"vanished before the kill: prompt {key[0]} block {key[1]}")
            if stats["slots"] < len(checked):
                res.details.append(f"disk slots {stats['slots']} < {len(checked)} blocks checked")
            self.checked = checked
            res.checked = len(checked)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(everyone, 30)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(kv.close(), 30)
            await master.close()
        return [p for ps in batch for p in ps], t_kill

    async def restart(self, res: LoopResult, t_kill: float) -> None:
        rig = self.rig
        old_log = await asyncio.to_thread(rig.kill_node)
        res.log_errors += problems(old_log, "killed node")
        for attempt in range(1, START_TRIES + 1):
            try:
                log = await asyncio.to_thread(rig.start_node)
                break
            except RuntimeError as exc:  # (counted; the run stops after START_TRIES)
                res.failed_starts += 1
                res.details.append(f"restart attempt {attempt} failed: {str(exc)[-400:]}")
                if attempt == START_TRIES:
                    raise
        res.restart_s = time.monotonic() - t_kill
        found = ADOPTED.search(log)
        if found:
            res.adopted = int(found.group(1))
            res.disk_open_s = float(found.group(3))
            res.torn_bytes = int(found.group(5))
        else:
            res.details.append("no 'adopted' line in the restarted node's log")
        res.torn_bytes = max(res.torn_bytes, sum(int(m.group(1)) for m in TORN.finditer(log)))
        res.log_errors += problems(log, "restarted node")
        self.restart_log = log

    async def verify(self, res: LoopResult, inflight: list[Prompt]) -> None:
        rig = self.rig
        seeds = sorted({s for s, _ in self.checked} | {p.seed for p in inflight})
        prompts = [self.prompts[s] for s in seeds]
        master = MasterClient(rig.master_addr, timeout_s=OP_TIMEOUT_S)
        try:
            nodes = await master.nodes()
            alive = [n for n in nodes if n.alive]
            if [n.node_id for n in alive] != [self.node_id]:
                res.details.append(f"live nodes after the restart: {[n.node_id for n in alive]}")
            held = await lookup(master, prompts)
        finally:
            await master.close()
        async with await client(rig) as kv:
            for p in prompts:
                rb = await read_back(kv, p, held)
                for i in range(BLOCKS):
                    key = (p.seed, i)
                    served_ok = rb.served[i] and not rb.wrong[i]
                    if rb.phantom[i]:
                        res.phantom += 1
                        res.details.append(f"phantom: prompt {p.seed} block {i}")
                    if key in self.checked:
                        if rb.wrong[i]:
                            res.corrupt += 1
                            res.details.append(f"corrupt: prompt {p.seed} block {i}")
                        elif not rb.served[i]:
                            res.lost += 1
                            res.details.append(
                                f"lost: prompt {p.seed} block {i} (on disk since loop "
                                f"{self.on_disk.get(key)})"
                            )
                        if not served_ok:
                            self.on_disk.pop(key, None)
                        continue
                    if p.batch != "inflight" or p.loop != res.loop:
                        continue
                    acked = i < p.acked_blocks
                    res.inflight_acked += acked
                    if acked and rb.wrong[i]:
                        res.corrupt += 1
                        res.details.append(f"corrupt (in flight): prompt {p.seed} block {i}")
                    elif acked and not rb.served[i]:
                        res.memory_only_lost += 1
                        age = (self.t_kill - p.acked_at) * 1000
                        old = res.memory_only_age_ms
                        res.memory_only_age_ms = age if old is None else max(old, age)
                    elif served_ok:
                        res.survived += acked
                        res.unacked_kept += not acked
                        self.on_disk.setdefault(key, res.loop)

    async def run(self) -> None:
        args, rig = self.args, self.rig
        await asyncio.to_thread(rig.start_master)
        first_log = await asyncio.to_thread(rig.start_node)
        master = MasterClient(rig.master_addr, timeout_s=OP_TIMEOUT_S)
        try:
            nodes = [n for n in await master.nodes() if n.alive]
        finally:
            await master.close()
        self.node_id = nodes[0].node_id
        boot = problems(first_log, "first node")
        with progress() as bar:
            task = bar.add_task("disk torture", total=args.loops)
            for loop in range(1, args.loops + 1):
                res = LoopResult(loop, log_errors=boot if loop == 1 else [])
                t0 = time.monotonic()
                await self.settled_batch(loop, res)
                inflight, t_kill = await self.inflight_and_kill(loop, res)
                await self.restart(res, t_kill)
                await self.verify(res, inflight)
                self.results.append(res)
                bad = res.corrupt + res.phantom + res.lost + res.vanished
                age = ""
                if res.memory_only_age_ms is not None:
                    age = f" (the oldest acked {res.memory_only_age_ms:.1f} ms before the kill)"
                bar.console.print(
                    f"loop {loop}: checked {res.checked}, corrupt {res.corrupt}, phantom "
                    f"{res.phantom}, lost {res.lost}, vanished {res.vanished}, memory-only lost "
                    f"{res.memory_only_lost}{age}, survived {res.survived}; killed after "
                    f"{res.layer_puts_before_kill}/{res.layer_puts_planned} layer puts (on "
                    f"{res.kill_on}, {res.kill_after_ack_ms:.1f} ms after an ack), "
                    f"{res.complete_at_kill} blocks complete, {res.queued_at_kill} queued; "
                    f"restart {res.restart_s:.2f} s, adopted {res.adopted}, torn "
                    f"{res.torn_bytes} B; {time.monotonic() - t0:.1f} s" + (" FAIL" if bad else "")
                )
                for line in res.details + res.log_errors:
                    bar.console.print(f"  loop {loop}: {line}")
                bar.update(task, advance=1, description=f"disk torture: {len(self.on_disk)} "
                                                        "blocks on disk")  # fmt: skip


def problems(log: str, who: str) -> list[str]:
    """The log's ERROR lines and tracebacks (each line once), named by who wrote them."""
    out = []
    for line in dict.fromkeys(log.splitlines()):
        if "ERROR" in line or "Traceback" in line or "CRITICAL" in line:
            out.append(f"{who} log: {line.strip()[:300]}")
    return out


# ---- the report -----------------------------------------------------------------------------


def summarize(
    args: argparse.Namespace, results: list[LoopResult], elapsed: float
) -> dict[str, Any]:
    restarts = [r.restart_s for r in results]
    opens = [r.disk_open_s for r in results]
    total = {
        k: sum(getattr(r, k) for r in results)
        for k in ("checked", "corrupt", "phantom", "lost", "vanished", "memory_only_lost",
                  "survived", "unacked_kept", "inflight_acked", "unproven",
                  "put_errors_before_kill", "torn_bytes", "failed_starts")
    }  # fmt: skip
    return {
        "loops": len(results),
        "elapsed_s": round(elapsed, 1),
        **total,
        "restart_s": {"p50": round(percentile(restarts, 50), 2), "max": round(max(restarts), 2)},
        "disk_open_s": {"p50": round(percentile(opens, 50), 3), "max": round(max(opens), 3)},
        "kills_with_queued": sum(r.queued_at_kill > 0 for r in results),
        "kills_before_a_write": sum(r.memory_only_lost > 0 for r in results),
        "kill_point_mean": round(
            statistics.fmean(r.layer_puts_before_kill / r.layer_puts_planned for r in results), 2
        ),
        "final_on_disk_blocks": results[-1].disk_slots_at_kill if results else 0,
        "log_errors": [f"loop {r.loop}: {e}" for r in results for e in r.log_errors],
        "details": [f"loop {r.loop}: {d}" for r in results for d in r.details],
        "per_loop": [
            {k: v for k, v in vars(r).items() if k not in ("details", "log_errors")}
            for r in results
        ],
    }


def tables(args: argparse.Namespace, s: dict[str, Any]) -> list[Table]:
    setup = Table("Setup", ["setting", "value"])
    for key in ("loops", "writers", "prompts_per_writer", "settled_prompts", "host_mem",
                "disk_size", "lease_s", "jitter_ms", "seed"):  # fmt: skip
        setup.add(key.replace("_", "-"), getattr(args, key))
    setup.add("elapsed s", s["elapsed_s"])
    setup.notes.append(
        f"one master, one node; {TOKENS}-token prompts of {LAYERS} layers in {BLOCK}-token "
        f"blocks, {HEADS} KV heads of {HEAD_DIM}, bf16, quant none: "
        f"{LAYERS * CHUNK_BYTES // 1024} KiB a block."
    )
    res = Table("Kill -9 of the node, restarted on its disk",
                ["loops", "blocks checked", "corrupt", "phantom", "lost", "vanished",
                 "memory-only lost", "restart s p50", "restart s max",
                 "torn bytes dropped"])  # fmt: skip
    res.add(s["loops"], s["checked"], s["corrupt"], s["phantom"], s["lost"], s["vanished"],
            s["memory_only_lost"], s["restart_s"]["p50"], s["restart_s"]["max"],
            s["torn_bytes"])  # fmt: skip
    res.notes += [
        "blocks checked: summed over the loops (each loop re-checks every block on disk "
        "since loop 1); corrupt, phantom, lost, vanished must be 0 (exit status 1 "
        "otherwise); memory-only lost: acknowledged in-flight blocks not yet on disk, gone "
        "after the restart (allowed).",
        f"in-flight blocks acknowledged {s['inflight_acked']}: {s['survived']} reached the "
        f"disk before the kill, {s['memory_only_lost']} did not; {s['unacked_kept']} "
        "blocks never acknowledged were kept whole (their ack lost in the kill).",
        f"restart s: kill to ready line (includes the wait for the old {args.lease_s:g} s "
        f"lease); opening the disk: p50 {s['disk_open_s']['p50']} s, max "
        f"{s['disk_open_s']['max']} s; torn bytes: from the restarted node's log.",
        f"kills with blocks still queued for the disk: {s['kills_with_queued']} of "
        f"{s['loops']} (one layer put before the kill); kills that left acknowledged blocks "
        f"off the disk: {s['kills_before_a_write']}; mean kill point "
        f"{s['kill_point_mean']:.0%} of the in-flight layer puts; blocks of settled "
        f"batches left unproven: {s['unproven']}; put errors before a kill: "
        f"{s['put_errors_before_kill']}; node log errors: {len(s['log_errors'])}; node "
        f"starts that failed (retried): {s['failed_starts']}.",
    ]
    return [setup, res]


def plot(s: dict[str, Any], path: str) -> None:
    loops = [str(r["loop"]) for r in s["per_loop"]]
    per = s["per_loop"]
    panels = [
        BarPanel(
            "blocks checked per loop", "blocks", loops, {"checked": [r["checked"] for r in per]}
        ),
        BarPanel("kill to ready", "s", loops, {"restart": [r["restart_s"] for r in per]}),
    ]
    save_bar_plot(
        path,
        panels,
        suptitle=f"disk torture: corrupt {s['corrupt']}, phantom {s['phantom']}, lost "
        f"{s['lost']}, memory-only lost {s['memory_only_lost']}",
        columns=1,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loops", type=int, default=50)
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--prompts-per-writer", type=int, default=2)
    parser.add_argument("--settled-prompts", type=int, default=2)
    parser.add_argument("--host-mem", default="8MiB")
    parser.add_argument("--disk-size", default="256MiB")
    parser.add_argument("--lease-s", type=float, default=2.0)
    parser.add_argument("--jitter-ms", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", default="", help="where the temp directory goes")
    parser.add_argument("--plot", default="")
    parser.add_argument("--json", default="")
    args = explain(parser, __doc__).parse_args(argv)
    if min(args.loops, args.writers, args.prompts_per_writer, args.settled_prompts) < 1:
        parser.error("--loops, --writers, --prompts-per-writer, --settled-prompts >= 1")
    per_loop = (args.settled_prompts + args.writers * args.prompts_per_writer) * BLOCKS
    worst = args.loops * per_loop * RECORD_BYTES
    if worst > 0.9 * parse_size(args.disk_size):
        need = worst / 0.9 / 2**20
        parser.error(f"{args.loops} loops may write {worst / 2**20:.0f} MiB: give --disk-size "
                     f"at least {need:.0f}MiB (the disk must never fill)")  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="kv-disk-torture-", dir=args.dir or None))
    rig = Rig(args, root)
    torture = Torture(args, rig)
    t0 = time.monotonic()
    crash = ""
    try:
        asyncio.run(torture.run())
    except Exception as exc:  # reported with what was measured, exit status 1
        crash = f"the run stopped in loop {len(torture.results) + 1}: {exc!r}"
        master_log = ""
        if rig.master is not None:
            master_log = rig.master.stderr_tail(4000)
        sys.stderr.write(f"{crash}\nnode log:\n{rig.log()[-4000:]}\nmaster log:\n{master_log}\n")
    finally:
        rig.stop()
        shutil.rmtree(root, ignore_errors=True)
    if not torture.results:
        return 1
    s = summarize(args, torture.results, time.monotonic() - t0)
    if crash:
        s["details"].insert(0, crash)
    print_report("Disk tier under kill -9", "bench/disk_torture.py", argv, tables(args, s))
    if s["log_errors"] or s["details"]:
        print("### Findings\n")
        for line in (s["details"] + s["log_errors"])[:50]:
            print(f"- {line}")
        print()
    if args.plot:
        plot(s, args.plot)
        print(f"Plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1))
    return 1 if crash or s["corrupt"] or s["phantom"] or s["lost"] or s["vanished"] else 0


if __name__ == "__main__":
    sys.exit(main())

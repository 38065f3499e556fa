"""The node's disk tier in use: what goes down to disk, what comes back up, and when.

- **Written behind.** Every block whose chunks have all landed in host memory is queued
  and written to disk in the background (:meth:`DiskTier.run`, batches on one writer
  thread), never on a put's path. A host slot whose disk record holds what it holds is
  *clean*: when host memory evicts it, it stays on the node on disk (the host tier's demote
  hook, :meth:`DiskTier.demote`), at no I/O cost. A block evicted before its write (puts
  outrunning the disk) leaves the node, counted. ``docs/decisions.md`` says why blocks are
  written when complete rather than when evicted.
- **Read up.** A read of a block held only on disk reads its record on a bounded pool of
  threads (checked before a byte is used) into a host slot (:meth:`DiskTier.stage`), one
  read however many requests want the block at once: *cold* on the block's first use, the
  next host victim, so a scan over disk blocks displaces no block in use; *warm* when it
  was read from disk recently (within the last :data:`RECENT_READS` disk reads) or read
  again while staged, past :data:`COLD_WINDOW_S` (the calls of one request's layers are
  one use), which is the admission rule.
- **Packed where it pays.** Blocks are written as byte planes + lz4 where the policy
  (:class:`~kvstore.node.disk_lz4.Lz4Policy`: the disk's and lz4's measured speeds, each
  namespace's learnt ratio) says reads get faster; everywhere else as they are.
- **Stored is stored.** A put naming chunks held only on disk is answered STORED for them
  (:meth:`~kvstore.node.tiers.Tiers.on_disk`), as for chunks in memory.
- **Leaves the node only from disk**: when the disk needs room its oldest segment goes, and
  its blocks that no memory tier holds are reported evicted.
- **Faults.** Each is counted (``kvstore_disk_errors_total``), logged in one line and
  named in the node's stats (``fault``); the node goes on serving from memory. A full file
  system shrinks the tier to what it holds (its next writes drop its oldest segments); any
  other failed write (EIO, read-only) stops writes for :data:`RETRY_S`. A record that
  fails its check or its read is dropped, and so are segments deleted underneath the tier
  (looked for every :data:`CHECK_S`); blocks no memory tier holds are reported evicted.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.control.records import BlockAdd
from kvstore.core.slots import Lease, Slot, SlotKey
from kvstore.dataplane.location import tier_mark, with_disk
from kvstore.errors import ChecksumError, KVStoreError
from kvstore.metrics import Metrics
from kvstore.node.disk import MAX_BATCH_BYTES, DiskStore, Record
from kvstore.node.disk_lz4 import Lz4Policy
from kvstore.node.tiers import Tiers, landed_bits

__all__ = [
    "CHECK_S",
    "COLD_WINDOW_S",
    "FAULTS",
    "MAX_QUEUE",
    "PIN_SHARE",
    "READ_THREADS",
    "RECENT_READS",
    "RETRY_S",
    "DiskTier",
]

logger = logging.getLogger("kvstore.node")

DISK_MARK = tier_mark("disk")

READ_THREADS = 4
"""Disk reads in flight at once (each on a thread of its own)."""
MAX_QUEUE = 65536
"""Blocks waiting to be written; past it the oldest waiting is skipped (it stays in memory
only, and leaves the node when host memory evicts it)."""
RECENT_READS = 4096
"""Disk reads remembered for the admission rule."""
PIN_SHARE = 8
"""A write batch pins at most 1/PIN_SHARE of host memory (puts need the rest)."""
FAULTS = (("write", "ENOSPC"), ("write", "EIO"), ("write", "EROFS"), ("read", "EIO"),
          ("read", "checksum"), ("check", "deleted"))  # fmt: skip
"""The faults the tier counts by name from its start (others are counted as they come)."""
COLD_WINDOW_S = 2.0
"""Reads of a block staged cold within this long of its staging do not mark it used: an
engine reads a prompt's layers in several calls, and they are one use."""
RETRY_S = 30.0
"""After a failed write, how long until writes are tried again (a full disk: none, the
tier shrinks instead)."""
CHECK_S = 5.0
"""How often the tier looks for segments deleted underneath it."""


@dataclass(eq=False)
class _Staging:
    """A read up from disk in flight, and how many stagings wait for it."""

    task: asyncio.Future[Lease[Slot] | None]
    waiters: int = 0


class DiskTier:
    """A node's disk tier: its :class:`DiskStore`, the write-behind queue and the reads.
    Owned by the node's event loop; I/O runs on the tier's own threads."""

    name = "disk"

    def __init__(
        self, store: DiskStore, tiers: Tiers, metrics: Metrics, lz4: Lz4Policy | None = None
    ) -> None:
        self.store = store
        self.lz4 = lz4 if lz4 is not None else Lz4Policy("off")
        self.tiers = tiers
        self.metrics = metrics
        self._queue: dict[SlotKey, None] = {}
        self._wake: asyncio.Event | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-disk-write")
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvstore-disk-read")
        self._reading = asyncio.Semaphore(READ_THREADS)
        self._batch = asyncio.Lock()
        """Held while a batch is planned and written (one at a time: the log has one
        tail)."""
        self._recent: dict[SlotKey, None] = {}
        self._staging: dict[SlotKey, _Staging] = {}
        """Reads up from disk in flight: a second read of the block waits for the first."""
        self._cold_since: dict[SlotKey, float] = {}
        """Blocks staged cold within the window, and when (oldest first)."""
        self._paused_until = 0.0
        """Monotonic time before which writes are not tried (after a fault)."""
        self.fault = ""
        """The last fault, one line ("" while none since the last good write)."""
        self._logged: set[tuple[str, str]] = set()
        """Read faults logged since the last good read (each logged once)."""
        self.counters = {"written": 0, "read": 0, "staged_cold": 0, "staged_warm": 0,
                         "unwritten_evictions": 0, "skipped": 0, "errors": 0}  # fmt: skip
        tiers.disk = self
        metrics.disk_blocks.set(len(store))
        for op, reason in FAULTS:  # (at 0 from the start: a rate of them has data)
            metrics.disk_errors.labels(op=op, reason=reason)

    # ---- write-behind ---------------------------------------------------------------------

    def queue(self, slots: list[Slot]) -> None:
        """Host slots whose chunks have all landed: write them (bounded queue)."""
        for slot in slots:
            if slot.complete and slot.key not in self._queue:
                self._queue[slot.key] = None
        while len(self._queue) > MAX_QUEUE:
            del self._queue[next(iter(self._queue))]
            self.counters["skipped"] += 1
        if self._queue and self._wake is not None:
            self._wake.set()

    @property
    def writing(self) -> bool:
        return time.monotonic() >= self._paused_until

    async def run(self, idle_s: float = 0.5) -> None:
        """Write queued blocks, batch after batch, until cancelled."""
        self._wake = asyncio.Event()
        checked = time.monotonic()
        while True:
            if time.monotonic() - checked >= CHECK_S:
                checked = time.monotonic()
                self.check()
            if not self._queue or not self.writing:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), idle_s)
                except TimeoutError:
                    pass
                continue
            try:
                await self._write_some()
            except Exception:  # a bug must not end the writes for good: log, go on
                logger.exception("disk tier: a write batch failed")
                await asyncio.sleep(idle_s)

    def check(self) -> None:
        """Drop the segments deleted underneath the tier (counted, reported evicted)."""
        gone = self.store.vanished()
        if gone:
            self.metrics.disk_errors.labels(op="check", reason="deleted").inc()
            self.counters["errors"] += 1
            self.fault = f"disk tier {self.store.path}: {len(gone)} blocks' segment deleted"
            self._gone(gone)

    async def flush(self, timeout_s: float) -> bool:
        """Write every queued block (tests, a node stopping); whether the queue emptied."""
        deadline = time.monotonic() + timeout_s
        while self._queue and self.writing and time.monotonic() < deadline:
            await self._write_some()
        async with self._batch:  # (the batch run() has in flight)
            return not self._queue

    async def _write_some(self) -> None:
        async with self._batch:
            await self._write_batch()

    async def _write_batch(self) -> None:
        host, store = self.tiers.host, self.store
        wanted: list[Record] = []
        views: list[list[memoryview]] = []
        leases: list[Lease[Slot]] = []
        later: list[SlotKey] = []
        taken = pinned = 0
        room = min(MAX_BATCH_BYTES, host.arena.capacity_bytes // PIN_SHARE)
        for key in list(itertools.islice(self._queue, 256)):
            if wanted and pinned >= room:
                break
            del self._queue[key]
            taken += 1
            slot = host.table.get(key)
            if slot is None or not slot.complete:
                continue
            rec = store.get(key)
            if rec is not None and rec.mask == slot.landed_mask:
                continue  # clean already
            if not self.tiers.movable(slot):
                later.append(key)  # its scrub is pending: write it once checked
                continue
            rec = Record.of(key, slot.parent, slot.owner, slot.slot_bytes, slot.chunk_bytes,
                            slot.num_chunks, slot.landed_mask, self.lz4.wants(key[0]))  # fmt: skip
            if not store.fits(rec):
                continue
            leases.append(host.table.pin(slot))
            pinned += slot.stride
            wanted.append(rec)
            views.append([memoryview(host.table.chunk_view(slot, i).numpy())  # type: ignore[arg-type]
                          for i in landed_bits(slot.landed_mask)])  # fmt: skip
        for key in later:
            self._queue[key] = None
        if not wanted:
            if later and taken == len(later):
                await asyncio.sleep(0.05)  # only blocks waiting on their scrub
            return
        plan, dropped = store.plan_batch(wanted)
        self._gone(dropped)
        n = len(plan.records) if plan is not None else 0
        for rec in wanted[n:]:  # (the next batch takes them)
            self._queue[rec.key] = None
        for lease in leases[n:]:
            lease.release()
        if plan is None:
            return
        asked = [rec.packed for rec in plan.records]
        t0 = time.perf_counter()
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._writer, store.write_batch, plan, views[:n])
        except Exception as exc:  # (OSError; anything else packing raised: the same, counted)
            store.abandon(plan)
            self._fault("write", exc)
            for rec in wanted[:n]:
                self._queue[rec.key] = None
            return
        finally:
            for lease in leases[:n]:
                lease.release()
        store.commit(plan)
        for rec, pack in zip(plan.records, asked, strict=True):
            self._mark(rec.key, rec.mask, on_disk=True)  # the index learns it survives a restart
            if pack:
                self.lz4.learn(rec.key[0], rec.raw_bytes, rec.payload_bytes)
        self.fault = ""
        self.counters["written"] += n
        self.metrics.disk_bytes.labels(op="write").inc(plan.nbytes)
        self.metrics.disk_seconds.labels(op="write").observe(time.perf_counter() - t0)
        self.metrics.disk_blocks.set(len(store))

    def _fault(self, op: str, exc: BaseException) -> None:
        """Count and log a failed disk operation; a failed write pauses writes."""
        reason = errno.errorcode.get(getattr(exc, "errno", 0) or 0, "error")
        if isinstance(exc, ChecksumError):
            reason = "checksum"
        self.metrics.disk_errors.labels(op=op, reason=reason).inc()
        self.counters["errors"] += 1
        line = f"disk tier {self.store.path}: {op} failed ({reason}): {exc}"
        if op == "write" and getattr(exc, "errno", None) == errno.ENOSPC:
            line += f"; the tier shrinks to {self.store.shrink()} bytes"
            logger.error("%s", line)  # (its next writes drop its oldest segments for room)
        elif op == "write":
            line += f"; writes stop for {RETRY_S:.0f} s, memory tiers go on"
            if self.writing:
                logger.error("%s", line)
            self._paused_until = time.monotonic() + RETRY_S
        else:
            line += "; the blocks that fail are dropped from disk"
            if (op, reason) not in self._logged:  # (once until a read succeeds again)
                logger.error("%s", line)
        self._logged.add((op, reason))
        self.fault = line

    def _mark(self, key: SlotKey, mask: int, on_disk: bool) -> None:
        """Say in the host slot's location (committed next) whether ``key`` has a disk
        copy of what the slot holds."""
        slot = self.tiers.host.table.get(key)
        if slot is None or slot.landed_mask != mask:
            return
        where = self.tiers.location(slot, self.tiers.host)
        marked = with_disk(where, on_disk)
        if marked != where:
            slot.location = marked
            self.tiers.moved(slot)

    def _gone(self, records: list[Record]) -> None:
        """Records the disk let go of: blocks no memory tier holds have left the node; a
        block host memory holds is no longer ``host+disk``, and is written again (it is in
        use: when host memory lets it go it stays on the node, while blocks written after
        it and never read since go with the next segments)."""
        keys = [r.key for r in records if self.tiers.holder(r.key) is None]
        for rec in records:
            self._mark(rec.key, rec.mask, on_disk=False)
        again = [s for r in records if (s := self.tiers.host.table.get(r.key)) is not None]
        if again:
            self.queue(again)
        if keys:
            self.tiers.evicted_from(self.name, keys)
        self.metrics.disk_blocks.set(len(self.store))

    # ---- host memory's demote hook --------------------------------------------------------

    def demote(self, victim: Slot) -> bool:
        """Host memory evicts ``victim``: True when its disk record holds what it holds
        (the block stays on the node, on disk), False when it leaves the node."""
        rec = self.store.get(victim.key)
        self._queue.pop(victim.key, None)
        if rec is not None and rec.mask == victim.landed_mask and victim.landed_mask:
            self.metrics.tier_moves.labels(to=self.name).inc()
            chunks = tuple(landed_bits(rec.mask))
            self.tiers.relocated(BlockAdd(victim.key[0], victim.key[1], chunks, DISK_MARK))
            return True
        if rec is not None:  # an older copy of another extent: the block leaves the node
            self.store.forget(victim.key)
            self._kill(rec)
        if victim.complete:
            self.counters["unwritten_evictions"] += 1
        return False

    # ---- reads ---------------------------------------------------------------------------

    async def stage(self, keys: list[SlotKey]) -> tuple[list[Lease[Slot]], set[SlotKey]]:
        """Bring the blocks of ``keys`` held only on disk into host memory for a read: their
        slots pinned (the leases, for the caller to release), and the keys the read must
        not mark used: those staged cold within the last :data:`COLD_WINDOW_S` (one
        request's reads of a block's layers are one use, however many calls they take)."""
        wanted = list(dict.fromkeys(keys))
        todo = [k for k in wanted if k in self.store and self.tiers.lookup(k) is None]
        leases: list[Lease[Slot]] = []
        if todo:
            # The request's blocks in memory are pinned first: staging the others must not
            # evict them (blocks staged cold earlier are the next victims).
            leases = [held[0].table.pin(held[1]) for k in wanted
                      if (held := self.tiers.lookup(k)) is not None]  # fmt: skip
            done = await asyncio.gather(*(self._stage_one(k) for k in todo))
            leases += [lease for lease in done if lease is not None]
        if not self._cold_since:
            return leases, set()
        since = time.monotonic() - COLD_WINDOW_S
        return leases, {k for k in wanted if self._cold_since.get(k, since) > since}

    async def _stage_one(self, key: SlotKey) -> Lease[Slot] | None:
        """Stage ``key``, or wait for the read of it in flight; a lease of its host slot
        (None: not staged). The read's own lease keeps the slot until its last waiter has
        pinned it (staging others would evict it: a block staged cold is the next victim)."""
        st = self._staging.get(key)
        if st is None:
            st = self._staging[key] = _Staging(asyncio.ensure_future(self._read_up(key)))
            st.task.add_done_callback(lambda _: self._settle(key, st))
        st.waiters += 1
        try:
            shared = await asyncio.shield(st.task)
        except Exception:  # (the read said why: a miss)
            shared = None
        finally:
            st.waiters -= 1
        try:
            if shared is None or shared.released:
                return None
            return self.tiers.host.table.pin(shared.target)
        finally:
            self._settle(key, st)

    def _settle(self, key: SlotKey, st: _Staging) -> None:
        """Once the read is done and no one waits for it, let go of its lease."""
        if st.waiters or not st.task.done():
            return
        if self._staging.get(key) is st:
            del self._staging[key]
        if not st.task.cancelled() and st.task.exception() is None:
            lease = st.task.result()
            if lease is not None:
                lease.release()

    async def _read_up(self, key: SlotKey) -> Lease[Slot] | None:
        """Read ``key``'s record and land it in a host slot; the slot's lease (None: not
        there)."""
        store = self.store
        rec = store.get(key)
        if rec is None or not store.pin(rec):
            return None
        t0 = time.perf_counter()
        try:
            async with self._reading:
                loop = asyncio.get_running_loop()
                payload = await loop.run_in_executor(self._readers, store.read, rec)
        except (OSError, ChecksumError) as exc:
            self._fault("read", exc)
            if store.get(key) is rec:
                store.forget(key)
                self._kill(rec)
                self._gone([rec])
            return None
        finally:
            store.unpin(rec)
        self._logged.clear()
        self.metrics.disk_bytes.labels(op="read").inc(rec.payload_bytes)
        self.metrics.disk_seconds.labels(op="read").observe(time.perf_counter() - t0)
        self.counters["read"] += 1
        try:
            return self._land(key, rec, payload)
        finally:
            store.give_back(payload)

    def _land(self, key: SlotKey, rec: Record, payload: memoryview) -> Lease[Slot] | None:
        """Copy a record read into a host slot (warm or cold, by the admission rule); the
        slot's lease (None: no room, everything pinned)."""
        host = self.tiers.host
        if (held := self.tiers.lookup(key)) is not None:  # stored meanwhile
            return held[0].table.pin(held[1]) if held[0] is host else None
        warm = self._recent.pop(key, "cold") is None
        if not warm:
            self._recent[key] = None
            while len(self._recent) > RECENT_READS:
                del self._recent[next(iter(self._recent))]
        try:
            res = host.table.allocate(key, rec.slot_bytes, rec.chunk_bytes, rec.num_chunks,
                                      rec.parent, rec.owner, cold=not warm)  # fmt: skip
        except KVStoreError as exc:  # no room (everything pinned): a miss for this read
            logger.info("disk tier: no host slot to stage %s into: %s", key[1].hex(), exc)
            return None
        self.tiers.evicted(host, res.evicted)
        slot = res.slot
        lease = host.table.pin(slot)
        src = np.frombuffer(payload, dtype=np.uint8)
        size = rec.chunk_bytes
        for j, index in enumerate(rec.chunk_indices()):
            host.table.chunk_view(slot, index).numpy()[:] = src[j * size : (j + 1) * size]
            host.table.mark_landed(slot, index)
        self.counters["staged_warm" if warm else "staged_cold"] += 1
        self.metrics.tier_moves.labels(to=host.name).inc()
        if warm:  # the index learns where it is now: host memory, and still the disk
            where = self.tiers.location(slot, host)
            slot.location = with_disk(where, slot.landed_mask == rec.mask)
            self.tiers.moved(slot)
        else:
            self._cold_since.pop(key, None)
            self._cold_since[key] = time.monotonic()
            self._expire_cold()
        return lease

    def _expire_cold(self) -> None:
        """Forget cold stagings older than the window (oldest first; bounded)."""
        since = time.monotonic() - COLD_WINDOW_S
        while self._cold_since:
            key = next(iter(self._cold_since))
            if self._cold_since[key] > since and len(self._cold_since) <= RECENT_READS:
                break
            del self._cold_since[key]

    # ---- removal, registration, stats -----------------------------------------------------

    def remove(self, keys: list[SlotKey]) -> int:
        """Drop the disk copies of ``keys`` for good (an operator's eviction, a bad chunk):
        forgotten now, their records killed on disk in the background; how many there were."""
        n = 0
        for key in keys:
            self._queue.pop(key, None)
            rec = self.store.forget(key)
            if rec is not None:
                n += 1
                self._kill(rec)
                self._mark(key, rec.mask, on_disk=False)
        self.metrics.disk_blocks.set(len(self.store))
        return n

    def note_namespace(self, pool_id: bytes, raw: bytes, tenant: str) -> None:
        """A namespace the node serves: kept on disk (in the background) with its blocks."""
        if self.store.namespaces.get(pool_id) == (raw, tenant):
            return
        self.store.namespaces[pool_id] = (raw, tenant)

        def save() -> None:
            try:
                self.store.save_namespaces()
            except OSError as exc:
                logger.warning("disk tier: cannot save its namespaces: %s", exc)

        self._writer.submit(save)

    def keys_of(self, ns_id: bytes) -> list[SlotKey]:
        return [k for k in self.store if k[0] == ns_id]

    def _kill(self, rec: Record) -> None:
        def kill() -> None:
            try:
                self.store.kill(rec)
            except OSError as exc:  # (said at debug level: the fault that led here was said)
                logger.debug("disk tier: cannot mark a dropped record dead: %s", exc)

        self._writer.submit(kill)

    def adds(self) -> list[BlockAdd]:
        """Commit items for every block held only on disk (what a registration reports)."""
        return [
            BlockAdd(k[0], k[1], tuple(rec.chunk_indices()), DISK_MARK)
            for k, rec in list(self.store.index.items())
            if self.tiers.holder(k) is None
        ]

    def stats(self) -> dict[str, Any]:
        """The tier's entry of the node's ``stats`` answer."""
        store = self.store
        return {
            "name": self.name,
            "slots": len(store),
            "pinned_slots": 0,
            "capacity_bytes": store.capacity,
            "used_bytes": store.live_bytes,
            "segment_bytes": store.used_bytes,
            "direct": store.direct,
            "queued": len(self._queue),
            "writing": self.writing,
            "fault": self.fault,
            "lz4": self.lz4.stats(),
            **self.counters,
        }

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.store.close()

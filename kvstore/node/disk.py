"""A node's disk tier: slots written to log-structured segment files below host memory.

Layout of ``--disk-path DIR``::

    kvstore-disk.json      who wrote it: format, node id, pool tag (see :func:`pool_tag`)
    seg-00000001.kvd       segments, appended one after another, each up to segment_bytes
    seg-00000002.kvd       ...

A segment is a sequence of records, each starting on a :data:`ALIGN` (4 KiB) boundary::

    record: header (HEADER struct, owner, landed mask, u64 header check) | pad to 64
            payload: the landed chunks of one slot, in chunk order | pad to ALIGN

A *packed* record (flag :data:`PACKED`) holds its chunks as byte planes + lz4 instead
(``kvstore/node/disk_lz4.py`` draws that payload and says when the tier packs).

The header names the slot (namespace id, block hash, parent, owner, geometry, landed mask),
a sequence number (the newest record of a key wins), the payload's length and its xxh3_64.
A record the node no longer wants (evicted by an operator, found bad) gets its magic
overwritten in place (:data:`DEAD_MAGIC`), so a restart does not bring it back; a whole
segment goes when the tier needs room (oldest first).

Writes are batched: the records of one batch are packed into one aligned buffer and
written with one ``pwrite`` at the segment's tail, with ``O_DIRECT`` where the file system
takes it (else through the page cache, said once in the log). Reads ``pread`` the record's
aligned range and check the header and the payload's xxh3_64 before a byte is served.

Thread model: :class:`DiskStore` keeps its index on the owner's thread (the node's event
loop) and does I/O only in :meth:`DiskStore.write_batch` and :meth:`DiskStore.read`, which
the caller runs on worker threads with plans the owner made (:meth:`plan_batch`,
:meth:`DiskStore.pin`). Opening (:meth:`DiskStore.open`) scans every segment's headers and
every byte of the newest one (where a crash leaves a torn tail), so it too belongs on a
worker thread.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import errno
import hashlib
import hmac
import json
import logging
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvstore.core.sizes import format_size
from kvstore.core.slots import SlotKey
from kvstore.errors import ChecksumError, InvalidArgument
from kvstore.node.disk_lz4 import pack_chunks, packed_size_ok, unpack_chunks

__all__ = [
    "ALIGN",
    "DEAD_MAGIC",
    "FORMAT",
    "IDENTITY_FILE",
    "MAX_BATCH_BYTES",
    "RECORD_MAGIC",
    "SEGMENT_BYTES",
    "DiskStore",
    "Record",
    "WritePlan",
    "pool_tag",
    "read_pieces",
]

logger = logging.getLogger("kvstore.node")

ALIGN = 4096
"""Record and write alignment: what ``O_DIRECT`` needs of offsets, lengths and buffers."""
SEGMENT_BYTES = 64 * 2**20
"""A segment is closed to appends once it holds this many bytes (one record may pass it)."""
MAX_BATCH_BYTES = 16 * 2**20
"""Bytes one write batch packs (one record larger than this goes alone)."""
READ_PIECE = 4 * 2**20
"""A record of several times this is read in as many pieces (of equal aligned sizes), all
at once, the payload hashed as each lands: read whole and then hashed, a 16 MiB record read
at 0.71 of raw ``O_DIRECT`` (the hash, ~2 ms of it, ran after the read)."""
PIECE_THREADS = 4
FORMAT = 2
"""2: records may be packed (flag :data:`PACKED`). A format-1 disk is adopted and marked 2
when opened (it holds no packed record; a binary that knows only format 1 then refuses the
disk instead of cutting its packed records off as torn tails)."""
READABLE_FORMATS = (1, 2)
IDENTITY_FILE = "kvstore-disk.json"
NAMESPACES_FILE = "namespaces.json"
"""The namespaces of the blocks on disk (canonical bytes and tenant, by pool id): a node
restarted on its disk knows them before any put names them again."""
RECORD_MAGIC = b"KVDR"
DEAD_MAGIC = b"KVDX"
_VERSION = 1
HEADER = struct.Struct("<4sHHQ16s16s16sBBHIQQQQ")
"""magic, version, header bytes (with owner, mask and check), seq, ns id, block, parent,
flags (1: has a parent, 2: packed), owner length, reserved, chunks, chunk bytes, slot bytes, payload
bytes, payload xxh3_64."""
_CHECK = struct.Struct("<Q")
HAS_PARENT = 1
PACKED = 2
"""Header flag: the payload is packed (``disk_lz4``), smaller than its chunks."""
_SEGMENT_NAME = re.compile(r"seg-(\d{8})\.kvd")
MAX_CHUNKS = 8 * (ALIGN - HEADER.size - 255 - _CHECK.size)
"""Chunks a slot may have and still get a record (its mask must fit the first page)."""


def read_pieces(span: int) -> list[tuple[int, int]]:
    """The byte ranges a record of ``span`` bytes is read in, at once (one range unless it
    is several :data:`READ_PIECE` long: a record just past one piece is one read)."""
    n = max(1, round(span / READ_PIECE))
    size = _up(-(-span // n))
    return [(a, min(a + size, span)) for a in range(0, span, size)]


class _Done:
    """A read done on the caller's thread, shaped as a piece read's future."""

    def __init__(self, got: int) -> None:
        self._got = got

    def result(self) -> int:
        return self._got


def pool_tag(secret: str) -> str:
    """What a disk records of the pool it belongs to: a digest of the cluster secret (never
    the secret), or ``""`` without one."""
    if not secret:
        return ""
    return hmac.new(secret.encode(), b"kvstore-disk-pool/1", hashlib.sha256).hexdigest()[:32]


def _up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


@dataclass(slots=True)
class Record:
    """Where one slot's disk copy lies and what it holds (the owner's index entry)."""

    key: SlotKey
    parent: bytes | None
    owner: str
    slot_bytes: int
    chunk_bytes: int
    num_chunks: int
    mask: int
    """The chunks the record holds (bit i: chunk i), stored in chunk order."""
    seq: int
    segment: int
    offset: int
    """Byte offset of the record in its segment (a multiple of :data:`ALIGN`)."""
    header_bytes: int
    payload_bytes: int
    """Bytes of the payload as stored (packed: fewer than its chunks')."""
    payload_check: int
    packed: bool = False
    """The payload is byte planes + lz4 (asked of :meth:`DiskStore.write_batch`, which
    stores it as it is where packing saves nothing)."""

    @classmethod
    def of(
        cls,
        key: SlotKey,
        parent: bytes | None,
        owner: str,
        slot_bytes: int,
        chunk_bytes: int,
        num_chunks: int,
        mask: int,
        packed: bool = False,
    ) -> Record:
        """The record a slot's landed chunks (``mask``) will get, not yet placed (see
        :meth:`DiskStore.plan_batch`); ``packed``: packed where that saves bytes."""
        hbytes = header_bytes_for(owner, num_chunks)
        payload = mask.bit_count() * chunk_bytes
        return cls(key, parent, owner, slot_bytes, chunk_bytes, num_chunks, mask, 0, 0, 0,
                   hbytes, payload, 0, packed)  # fmt: skip

    @property
    def span(self) -> int:
        """Bytes the record occupies in its segment (aligned)."""
        return _up(self.payload_at + self.payload_bytes)

    @property
    def payload_at(self) -> int:
        return _up(self.header_bytes, 64)

    @property
    def raw_bytes(self) -> int:
        """Bytes of the chunks the record holds (its payload's, unpacked)."""
        return self.mask.bit_count() * self.chunk_bytes

    def chunk_indices(self) -> list[int]:
        return [i for i in range(self.mask.bit_length()) if self.mask >> i & 1]


@dataclass
class WritePlan:
    """One batch: where its records go (planned on the owner's thread)."""

    segment: int
    offset: int
    records: list[Record]
    nbytes: int
    """Bytes the batch takes: what is reserved for it, then (once written) what packed
    records left of that."""
    reserved: int = 0


@dataclass(eq=False)
class _Segment:
    number: int
    path: Path
    fd: int
    size: int = 0
    """Bytes appended (a multiple of ALIGN)."""
    live: set[SlotKey] = field(default_factory=set)
    readers: int = 0
    doomed: bool = False
    """Dropped: unlinked; its fd closes when its last reader is done."""


def encode_header(rec: Record) -> bytes:
    """The record's header bytes (``rec.header_bytes`` long)."""
    owner = rec.owner.encode()
    mask = rec.mask.to_bytes(_up(max(rec.num_chunks, 1), 8) // 8, "little")
    body = HEADER.pack(
        RECORD_MAGIC, _VERSION, rec.header_bytes, rec.seq, rec.key[0], rec.key[1],
        rec.parent or bytes(16),
        (HAS_PARENT if rec.parent is not None else 0) | (PACKED if rec.packed else 0),
        len(owner), 0,
        rec.num_chunks, rec.chunk_bytes, rec.slot_bytes, rec.payload_bytes, rec.payload_check,
    ) + owner + mask  # fmt: skip
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def header_bytes_for(owner: str, num_chunks: int) -> int:
    return HEADER.size + len(owner.encode()) + _up(max(num_chunks, 1), 8) // 8 + _CHECK.size


def parse_header(buf: bytes | memoryview, segment: int, offset: int) -> Record | None:
    """The record whose header starts ``buf`` (at least its header bytes), or None when
    ``buf`` holds no intact record header (a torn or never-written tail, a dead record)."""
    if len(buf) < HEADER.size:
        return None
    (magic, version, hbytes, seq, ns_id, block, parent, flags, owner_len, _, chunks, chunk_bytes,
     slot_bytes, payload_bytes, check) = HEADER.unpack_from(buf)  # fmt: skip
    if magic != RECORD_MAGIC or version != _VERSION or not HEADER.size < hbytes <= ALIGN:
        return None
    if hbytes > len(buf) or not 0 < chunks <= MAX_CHUNKS:
        return None
    mask_len = _up(chunks, 8) // 8
    if hbytes != HEADER.size + owner_len + mask_len + _CHECK.size:
        return None
    body = bytes(buf[: hbytes - _CHECK.size])
    if _CHECK.unpack_from(buf, hbytes - _CHECK.size)[0] != xxhash.xxh3_64_intdigest(body):
        return None
    owner = body[HEADER.size : HEADER.size + owner_len].decode(errors="replace")
    mask = int.from_bytes(body[HEADER.size + owner_len :], "little")
    raw, packed = mask.bit_count() * chunk_bytes, bool(flags & PACKED)
    if mask >> chunks or not (packed_size_ok(payload_bytes, raw, mask.bit_count()) if packed
                              else payload_bytes == raw):  # fmt: skip
        return None
    return Record(
        (ns_id, block), parent if flags & HAS_PARENT else None, owner, slot_bytes, chunk_bytes,
        chunks, mask, seq, segment, offset, hbytes, payload_bytes, check, packed,
    )  # fmt: skip


class _Buffers:
    """Page-aligned buffers for ``O_DIRECT`` reads, reused (bounded: ``keep`` bytes idle)."""

    def __init__(self, keep: int = 128 * 2**20) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._idle = 0
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        # Sizes a power of two up to 1 MiB, then whole MiB: a 16 MiB slot's record takes
        # 17 MiB, not 32.
        size = max(ALIGN, 1 << (nbytes - 1).bit_length()) if nbytes <= 2**20 else _up(nbytes, 2**20)
        with self._lock:
            pool = self._free.get(size)
            if pool:
                self._idle -= size
                return pool.pop()
        return mmap.mmap(-1, size)

    def give(self, buf: mmap.mmap) -> None:
        with self._lock:
            if self._idle + len(buf) <= self._keep:
                self._free.setdefault(len(buf), []).append(buf)
                self._idle += len(buf)
                return
        with contextlib.suppress(BufferError):  # (a view still out: the GC frees it)
            buf.close()


class DiskStore:
    """The records of one ``--disk-path``: an index of what is where, the segments, and the
    two I/O calls (batch write, record read) callers run on worker threads.

    ``capacity`` bytes of segments at most (the oldest segment is dropped to make room).
    ``direct=None`` uses ``O_DIRECT`` when the file system takes it. Not thread-safe except
    as the module docstring says.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity: int,
        *,
        segment_bytes: int = SEGMENT_BYTES,
        direct: bool | None = None,
    ) -> None:
        if capacity < 2 * ALIGN:
            raise InvalidArgument(f"--disk-size must be at least {2 * ALIGN} bytes")
        self.path = Path(path)
        self.capacity = capacity
        self.segment_bytes = max(ALIGN, _up(min(segment_bytes, max(capacity // 4, ALIGN))))
        self.index: dict[SlotKey, Record] = {}
        self._live_bytes = 0
        self._segments: dict[int, _Segment] = {}
        """Every segment by number, dropped ones included until their last reader is done."""
        self._open: dict[int, _Segment] = {}
        """The segments not dropped, oldest first."""
        self._used_bytes = 0
        self._next_segment = 1
        self._seq = 0
        self._direct = direct
        self._write_buf = mmap.mmap(-1, MAX_BATCH_BYTES)
        self._read_bufs = _Buffers()
        self._pieces = ThreadPoolExecutor(PIECE_THREADS, "kvstore-disk-piece")
        """Reads the pieces of a large record at once (its threads start on first use)."""
        self.namespaces: dict[bytes, tuple[bytes, str]] = {}
        """Pool id -> (the namespace's canonical bytes, its tenant), for the blocks here."""
        self.dropped_tail_bytes = 0
        """Bytes of torn or unreadable tails dropped when the store opened."""

    # ---- opening ------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        capacity: int,
        *,
        node_id: str,
        secret: str = "",
        segment_bytes: int = SEGMENT_BYTES,
        direct: bool | None = None,
    ) -> DiskStore:
        """Open (creating it if need be) the disk at ``path`` for node ``node_id``: adopt
        every intact record, drop torn tails. Raises :class:`InvalidArgument` when ``path``
        belongs to another node or pool, or holds files this tier did not write, and
        ``OSError`` when it cannot be created, read or written at all."""
        store = cls(path, capacity, segment_bytes=segment_bytes, direct=direct)
        store.path.mkdir(parents=True, exist_ok=True)
        store._claim(node_id, pool_tag(secret))
        store._probe_direct()
        try:
            store._scan()
        except BaseException:
            store.close()
            raise
        store._load_namespaces()
        return store

    def _load_namespaces(self) -> None:
        path = self.path / NAMESPACES_FILE
        try:
            saved = json.loads(path.read_text())
            self.namespaces = {
                bytes.fromhex(pool): (base64.b64decode(entry["ns"]), str(entry["tenant"]))
                for pool, entry in saved.items()
            }
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("disk tier %s: %s is unreadable (%s); namespaces are learnt from "
                           "puts again", self.path, NAMESPACES_FILE, exc)  # fmt: skip

    def save_namespaces(self) -> None:
        """Worker thread: write :attr:`namespaces` (atomically). ``OSError`` if it fails."""
        doc = {pool.hex(): {"ns": base64.b64encode(raw).decode(), "tenant": tenant}
               for pool, (raw, tenant) in list(self.namespaces.items())}  # fmt: skip
        tmp = self.path / ("." + NAMESPACES_FILE + ".tmp")
        tmp.write_text(json.dumps(doc) + "\n")
        os.replace(tmp, self.path / NAMESPACES_FILE)

    @staticmethod
    def owner_of(path: str | os.PathLike[str]) -> str | None:
        """The node id a disk at ``path`` was written by (None: no disk there yet)."""
        try:
            meta = json.loads((Path(path) / IDENTITY_FILE).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"{Path(path) / IDENTITY_FILE} is unreadable: {exc}") from exc
        node_id = meta.get("node_id") if isinstance(meta, dict) else None
        return node_id if isinstance(node_id, str) else None

    def _claim(self, node_id: str, tag: str) -> None:
        ident = self.path / IDENTITY_FILE
        names = [p.name for p in self.path.iterdir() if not p.name.startswith(".")]
        segments = [n for n in names if _SEGMENT_NAME.fullmatch(n)]
        strangers = sorted(set(names) - set(segments) - {IDENTITY_FILE, NAMESPACES_FILE})
        if ident.exists():
            try:
                meta = json.loads(ident.read_text())
            except (OSError, ValueError) as exc:
                raise InvalidArgument(f"{ident} is unreadable: {exc}") from exc
            if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
                known = " or ".join(map(str, READABLE_FORMATS))
                raise InvalidArgument(f"{ident}: not a kvstore disk of format {known}")
            if meta.get("node_id") != node_id:
                raise InvalidArgument(
                    f"disk {self.path} belongs to node {meta.get('node_id')!r}, not "
                    f"{node_id!r}: start that node on it, or give this one an empty directory"
                )
            if meta.get("pool") != tag:
                theirs = "a cluster secret" if meta.get("pool") else "no cluster secret"
                mine = "none" if not tag else "a different one" if meta.get("pool") else "one"
                raise InvalidArgument(
                    f"disk {self.path} was written under another cluster secret ({theirs}; "
                    f"this node has {mine}): its blocks are not this pool's: give this node "
                    "an empty directory"
                )
            if meta["format"] != FORMAT:  # (older: what it holds reads the same)
                self._write_identity(node_id, tag)
            return
        if strangers or segments:
            what = ", ".join(strangers)[:200] or f"segments with no {IDENTITY_FILE}"
            raise InvalidArgument(
                f"disk {self.path} holds files this tier did not write ({what}): give the "
                "disk tier a directory of its own"
            )
        self._write_identity(node_id, tag)

    def _write_identity(self, node_id: str, tag: str) -> None:
        ident = self.path / IDENTITY_FILE
        tmp = ident.with_name("." + IDENTITY_FILE + ".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "node_id": node_id, "pool": tag}) + "\n")
        os.replace(tmp, ident)

    def _probe_direct(self) -> None:
        """Settle whether segments are opened with ``O_DIRECT`` (one probe write)."""
        if self._direct is False or not hasattr(os, "O_DIRECT"):
            self._direct = False
            return
        probe = self.path / ".direct-probe"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            try:
                buf = mmap.mmap(-1, ALIGN)
                os.pwrite(fd, buf, 0)
                os.preadv(fd, [buf], 0)
                buf.close()
            finally:
                os.close(fd)
            self._direct = True
        except OSError as exc:
            if self._direct:  # asked for explicitly
                raise
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            logger.warning(
                "disk tier %s: the file system refuses O_DIRECT (%s); using the page cache",
                self.path, exc.strerror,
            )  # fmt: skip
            self._direct = False
        finally:
            probe.unlink(missing_ok=True)

    def measure_read(self, nbytes: int = 16 * 2**20, unit: int = 4 * 2**20) -> float:
        """Worker thread: this disk's sequential read GB/s, as the tier reads it (``unit``
        reads of a file of ``nbytes`` written and flushed out of the page cache first)."""
        probe = self.path / ".read-probe"
        buf = mmap.mmap(-1, unit)
        buf.write(os.urandom(min(unit, 2**16)) * (unit // min(unit, 2**16)))
        try:
            fd = self._open_fd(probe, create=not probe.exists())
            try:
                for at in range(0, nbytes, unit):
                    os.pwrite(fd, buf, at)
                os.fsync(fd)
                best = float("inf")
                for _ in range(3):  # (best of 3: a disk waking up is not its speed)
                    os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
                    t0 = time.perf_counter()
                    for at in range(0, nbytes, unit):
                        os.preadv(fd, [buf], at)
                    best = min(best, time.perf_counter() - t0)
                return nbytes / best / 1e9
            finally:
                os.close(fd)
        finally:
            buf.close()
            probe.unlink(missing_ok=True)

    @property
    def direct(self) -> bool:
        """Whether segments bypass the page cache (``O_DIRECT``)."""
        return bool(self._direct)

    def _open_fd(self, path: Path, create: bool) -> int:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        if self._direct:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o600)

    def _scan(self) -> None:
        """Adopt every intact record, newest sequence number winning; check every payload
        byte of the newest segment (a crash tears only the tail being appended) and cut
        it at its first bad record."""
        names = sorted(
            (int(m.group(1)), p)
            for p in self.path.iterdir()
            if (m := _SEGMENT_NAME.fullmatch(p.name))
        )
        for i, (number, path) in enumerate(names):
            newest = i == len(names) - 1
            seg = self._add_segment(number, path, create=False)
            end = os.fstat(seg.fd).st_size
            try:
                self._resize(seg, self._scan_segment(seg, end, verify=newest))
            except OSError as exc:  # unreadable: keep what was adopted, cut nothing
                logger.error("disk tier %s: %s is unreadable past what was adopted: %s",
                             self.path, path.name, exc)  # fmt: skip
                self._resize(seg, end)
                continue
            if seg.size < end:
                self.dropped_tail_bytes += end - seg.size
                os.ftruncate(seg.fd, seg.size)
                logger.warning(
                    "disk tier %s: dropped %d bytes of torn tail from %s",
                    self.path, end - seg.size, path.name,
                )  # fmt: skip
        if self._used_bytes > self.capacity:  # (a smaller --disk-size: a typo would empty it)
            need = format_size(-(-self._used_bytes // 2**20) * 2**20)
            raise InvalidArgument(
                f"disk {self.path} holds {format_size(self._used_bytes)} in "
                f"{len(self._segments)} segments ({len(self.index)} blocks), more than "
                f"--disk-size {format_size(self.capacity)}: start the node with --disk-size "
                f"{need} or more, or give it an empty directory to drop them"
            )

    def _scan_segment(self, seg: _Segment, end: int, verify: bool) -> int:
        """Index ``seg``'s records; the bytes up to its last intact one."""
        offset = 0
        buf = mmap.mmap(-1, ALIGN)
        try:
            while offset + ALIGN <= end:
                if os.preadv(seg.fd, [buf], offset) != ALIGN:
                    break
                if buf[:4] == DEAD_MAGIC:
                    (span,) = struct.unpack_from("<Q", buf, 8)
                    if span <= 0 or span % ALIGN or offset + span > end:
                        break
                    offset += span
                    continue
                rec = parse_header(memoryview(buf), seg.number, offset)
                if rec is None or offset + rec.span > end:
                    break
                if verify:
                    try:
                        self.read(rec, keep=False)
                    except ChecksumError:
                        break
                self._adopt(seg, rec)
                offset += rec.span
        finally:
            buf.close()
        return offset

    def _adopt(self, seg: _Segment, rec: Record) -> None:
        self._seq = max(self._seq, rec.seq)
        old = self.index.get(rec.key)
        if old is None or old.seq < rec.seq:
            self._put(seg, rec)

    def _put(self, seg: _Segment, rec: Record) -> Record | None:
        """Index ``rec`` (in ``seg``) in place of ``rec.key``'s record; the one replaced."""
        old = self._pop(rec.key)
        self.index[rec.key] = rec
        seg.live.add(rec.key)
        self._live_bytes += rec.span
        return old

    def _pop(self, key: SlotKey) -> Record | None:
        """Take ``key``'s record out of the index; the record."""
        rec = self.index.pop(key, None)
        if rec is not None:
            self._live_bytes -= rec.span
            if (seg := self._segments.get(rec.segment)) is not None:
                seg.live.discard(key)
        return rec

    # ---- accounting -----------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of segments on disk (live records, dead ones and padding)."""
        return self._used_bytes

    @property
    def live_bytes(self) -> int:
        """Bytes of the records indexed (what the tier holds)."""
        return self._live_bytes

    @property
    def segments(self) -> int:
        return len(self._open)

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def get(self, key: SlotKey) -> Record | None:
        return self.index.get(key)

    def __iter__(self) -> Iterator[SlotKey]:
        """The keys held (a snapshot: the index may change while it is walked)."""
        return iter(list(self.index))

    # ---- writes -------------------------------------------------------------------------

    def fits(self, rec: Record) -> bool:
        """Whether ``rec`` can be written at all (its header fits a page, its record half
        the tier)."""
        owner_ok = len(rec.owner.encode()) <= 255
        return owner_ok and rec.num_chunks <= MAX_CHUNKS and rec.span <= self.capacity // 2

    def plan_batch(self, wanted: Iterable[Record]) -> tuple[WritePlan | None, list[Record]]:
        """Place records (from :meth:`Record.of`, each one that :meth:`fits`) at the newest
        segment's tail, as many as one batch takes (at least one, in order); the plan
        (None: nothing to write) and the records of segments dropped to make room, no
        longer indexed (the caller reports the keys no other tier holds)."""
        seg = self._tail()
        if seg is not None and seg.size >= self.segment_bytes:
            seg = None
        room = min(MAX_BATCH_BYTES, self.capacity // 2)
        records: list[Record] = []
        nbytes = 0
        for rec in wanted:
            if records and nbytes + rec.span > room:
                break
            self._seq += 1
            rec.seq = self._seq
            records.append(rec)
            nbytes += rec.span
            if (seg.size if seg is not None else 0) + nbytes >= self.segment_bytes:
                break
        if not records:
            return None, []
        dropped = self._trim(nbytes)
        if seg is None or seg.doomed:
            seg = self._new_segment()
        offset = seg.size
        for rec in records:
            rec.segment, rec.offset = seg.number, offset
            offset += rec.span
        plan = WritePlan(seg.number, seg.size, records, nbytes, nbytes)
        self._resize(seg, seg.size + nbytes)  # reserved: the next plan goes after it
        return plan, dropped

    def _tail(self) -> _Segment | None:
        return next(reversed(self._open.values()), None)

    def _new_segment(self) -> _Segment:
        number = self._next_segment
        return self._add_segment(number, self.path / f"seg-{number:08d}.kvd", create=True)

    def _add_segment(self, number: int, path: Path, create: bool) -> _Segment:
        """Open segment ``number`` (the newest so far) at ``path``."""
        seg = _Segment(number, path, self._open_fd(path, create=create))
        self._segments[number] = self._open[number] = seg
        self._next_segment = number + 1
        return seg

    def _resize(self, seg: _Segment, size: int) -> None:
        """``seg`` (not dropped) now holds ``size`` bytes."""
        self._used_bytes += size - seg.size
        seg.size = size

    def _trim(self, incoming: int) -> list[Record]:
        """Drop the oldest segments until ``incoming`` more bytes fit; the records dropped."""
        dropped: list[Record] = []
        while self._used_bytes + incoming > self.capacity:
            oldest = next(iter(self._open.values()), None)
            if oldest is None or (len(self._open) == 1 and oldest.size == 0):
                break
            dropped.extend(self._drop_segment(oldest))
        return dropped

    def _drop_segment(self, seg: _Segment) -> list[Record]:
        seg.doomed = True
        del self._open[seg.number]
        self._used_bytes -= seg.size
        gone = [r for k in list(seg.live) if (r := self._pop(k)) is not None]
        try:
            seg.path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("disk tier: cannot remove %s: %s", seg.path, exc)
        self._release(seg)
        return gone

    def shrink(self) -> int:
        """The file system is full: the tier takes no more than it holds now (its next
        writes make room by dropping its oldest segments); the new capacity."""
        self.capacity = max(2 * ALIGN, self.used_bytes)
        self.segment_bytes = max(ALIGN, _up(min(self.segment_bytes, self.capacity // 4)))
        return self.capacity

    def vanished(self) -> list[Record]:
        """Drop the segments deleted underneath the tier (their files unlinked by someone
        else: a restart would not find them); the records dropped, no longer indexed."""
        gone: list[Record] = []
        for seg in list(self._open.values()):
            try:
                linked = os.fstat(seg.fd).st_nlink > 0
            except OSError:
                linked = False
            if not linked:
                logger.error(
                    "disk tier %s: segment %s was deleted underneath it; its %d blocks are "
                    "dropped", self.path, seg.path.name, len(seg.live),
                )  # fmt: skip
                gone += self._drop_segment(seg)
        return gone

    def _release(self, seg: _Segment) -> None:
        if seg.doomed and seg.readers == 0 and seg.fd >= 0:
            os.close(seg.fd)
            seg.fd = -1
            del self._segments[seg.number]

    def write_batch(self, plan: WritePlan, views: list[list[memoryview]]) -> None:
        """Worker thread: write ``plan``'s records, their payloads from ``views`` (each
        record's landed chunks, one buffer each, in chunk order), in one aligned ``pwrite``.
        Packs the records asked to be where that saves bytes (the records after a packed
        one move up: ``plan.nbytes`` is what the batch took); fills each record's payload
        check. Raises ``OSError`` (nothing of the batch is indexed)."""
        if len(self._write_buf) < plan.nbytes:  # (one record past a batch: kept for the next)
            self._write_buf.close()
            self._write_buf = mmap.mmap(-1, _up(plan.nbytes, 2**20))
        buf = self._write_buf
        pos = 0
        for rec, chunks in zip(plan.records, views, strict=True):
            if sum(len(c) for c in chunks) != rec.raw_bytes:
                raise InvalidArgument(f"slot {rec.key[1].hex()}: payload size changed")
            packed = pack_chunks(chunks) if rec.packed else None
            if packed is not None and _up(rec.payload_at + sum(map(len, packed))) >= rec.span:
                packed = None  # (it saves no aligned room: no read would get faster)
            rec.packed = packed is not None
            parts: list[bytes | memoryview] = packed if packed is not None else list(chunks)
            rec.payload_bytes = sum(len(p) for p in parts)
            rec.offset = plan.offset + pos
            start = pos + rec.payload_at
            h = xxhash.xxh3_64()
            at = start
            for part in parts:
                buf[at : at + len(part)] = part
                h.update(part)
                at += len(part)
            rec.payload_check = h.intdigest()
            head = encode_header(rec)
            buf[pos : pos + len(head)] = head
            buf[pos + len(head) : start] = bytes(start - pos - len(head))
            end = pos + rec.span
            buf[at:end] = bytes(end - at)
            pos = end
        plan.nbytes = pos
        seg = self._segments[plan.segment]
        done = os.pwrite(seg.fd, memoryview(buf)[: plan.nbytes], plan.offset)
        if done != plan.nbytes:
            # (a regular file takes a short write only when its file system is full)
            raise OSError(errno.ENOSPC, f"short write ({done} of {plan.nbytes} bytes)")

    def abandon(self, plan: WritePlan) -> None:
        """``plan``'s write failed: give its room back (it is the segment's last), so the
        next batch does not leave unreadable bytes between records."""
        seg = self._segments.get(plan.segment)
        if seg is not None and not seg.doomed and seg.size == plan.offset + plan.reserved:
            self._resize(seg, plan.offset)

    def commit(self, plan: WritePlan) -> list[Record]:
        """Index ``plan``'s records once written; the records they superseded."""
        seg = self._segments.get(plan.segment)
        if seg is None or seg.doomed:  # (dropped while written: nothing of it is kept)
            return []
        if seg.size == plan.offset + plan.reserved:  # what packing saved goes to the next
            self._resize(seg, plan.offset + plan.nbytes)
        return [old for rec in plan.records if (old := self._put(seg, rec)) is not None]

    def forget(self, key: SlotKey) -> Record | None:
        """Drop ``key``'s record from the index (its bytes stay until :meth:`kill` or its
        segment goes); the record."""
        return self._pop(key)

    def kill(self, rec: Record) -> None:
        """Worker thread: overwrite ``rec``'s first page with a dead marker, so a restart
        does not bring it back. ``OSError`` when the write fails."""
        seg = self._segments.get(rec.segment)
        if seg is None or seg.fd < 0:
            return
        buf = mmap.mmap(-1, ALIGN)
        try:
            buf[:4] = DEAD_MAGIC
            struct.pack_into("<Q", buf, 8, rec.span)
            os.pwrite(seg.fd, buf, rec.offset)
        finally:
            buf.close()

    # ---- reads ---------------------------------------------------------------------------

    def pin(self, rec: Record) -> bool:
        """Owner's thread, before a :meth:`read`: keep ``rec``'s segment open until
        :meth:`unpin`; False when the record is no longer indexed."""
        seg = self._segments.get(rec.segment)
        if seg is None or seg.doomed or self.index.get(rec.key) is not rec:
            return False
        seg.readers += 1
        return True

    def unpin(self, rec: Record) -> None:
        seg = self._segments.get(rec.segment)
        if seg is not None:
            seg.readers -= 1
            self._release(seg)

    def read(self, rec: Record, keep: bool = True) -> memoryview:
        """Worker thread: ``rec``'s chunks (unpacked), its header and checksum verified; a
        view of a reused buffer the caller hands back with :meth:`give_back` (``keep=False``:
        verify only, returning an empty view). Raises :class:`ChecksumError` for a record
        that does not verify, ``OSError`` when the read fails."""
        seg = self._segments.get(rec.segment)
        if seg is None or seg.fd < 0:
            raise OSError(errno.ENOENT, f"segment {rec.segment} is gone")
        buf = self._read_bufs.take(rec.span)
        at, end = rec.payload_at, rec.payload_at + rec.payload_bytes
        try:
            self._read_checked(seg.fd, rec, memoryview(buf)[: rec.span])
        except BaseException:
            self._read_bufs.give(buf)
            raise
        if not keep:
            self._read_bufs.give(buf)
            return memoryview(b"")
        if not rec.packed:
            return memoryview(buf)[at:end]
        out = self._read_bufs.take(rec.raw_bytes)
        try:
            unpack_chunks(memoryview(buf)[at:end], memoryview(out)[: rec.raw_bytes],
                          rec.mask.bit_count(), rec.chunk_bytes)  # fmt: skip
        except BaseException:
            self._read_bufs.give(out)
            raise
        finally:
            self._read_bufs.give(buf)
        return memoryview(out)[: rec.raw_bytes]

    def _read_checked(self, fd: int, rec: Record, view: memoryview) -> None:
        """Read ``rec`` into ``view``: its header checked, its payload hashed piece by piece
        as the pieces land (a record of more than :data:`READ_PIECE` is read in pieces at
        once, so the hash runs beside the reads). :class:`ChecksumError` if it fails."""
        pieces = read_pieces(len(view))
        reads: list[_Done | Future[int]]
        if len(pieces) == 1:
            reads = [_Done(os.preadv(fd, [view], rec.offset))]
        else:
            reads = [self._pieces.submit(os.preadv, fd, [view[a:b]], rec.offset + a)
                     for a, b in pieces]  # fmt: skip
        try:
            at, end = rec.payload_at, rec.payload_at + rec.payload_bytes
            h = xxhash.xxh3_64()
            for (a, b), done in zip(pieces, reads, strict=True):
                if (got := done.result()) != b - a:
                    raise ChecksumError(f"record {rec.key[1].hex()}: short read ({got} of "
                                        f"{b - a} at {a})")  # fmt: skip
                if a == 0:
                    again = parse_header(view[:ALIGN], rec.segment, rec.offset)
                    if again is None or (again.key, again.seq) != (rec.key, rec.seq):
                        raise ChecksumError(f"record {rec.key[1].hex()}: header does not verify")
                if max(a, at) < min(b, end):
                    h.update(view[max(a, at) : min(b, end)])
            if h.intdigest() != rec.payload_check:
                raise ChecksumError(f"record {rec.key[1].hex()}: payload checksum mismatch")
        finally:
            concurrent.futures.wait([r for r in reads if isinstance(r, Future)])  # (the buffer
            # goes back to the pool: no piece may still be landing in it)

    def give_back(self, payload: memoryview) -> None:
        """Return a :meth:`read`'s buffer for reuse (the view must not be used after)."""
        base = payload.obj
        payload.release()
        if isinstance(base, mmap.mmap):
            self._read_bufs.give(base)

    def close(self) -> None:
        for seg in list(self._segments.values()):
            if seg.fd >= 0:
                os.close(seg.fd)
                seg.fd = -1
        self._segments.clear()
        self._open.clear()
        self._used_bytes = 0
        self._write_buf.close()
        self._pieces.shutdown(wait=True)

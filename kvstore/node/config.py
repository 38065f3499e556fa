"""A storage node's settings: :class:`NodeConfig` (``kvstore node`` and ``kvstore serve``
build one from their flags; :class:`~kvstore.node.server.StorageNode` validates it)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from kvstore.control.tls import TlsFiles
from kvstore.node.scrub import MAX_PENDING_BYTES

__all__ = ["NodeConfig"]


@dataclass(frozen=True)
class NodeConfig:
    """A storage node's settings (validated by :class:`StorageNode`)."""

    master: str
    host: str = "127.0.0.1"
    data_port: int = 50052
    node_id: str = ""
    host_mem: int = 512 * 2**20
    gpu_mem: int = 0
    """Bytes of the GPU tier (0: none): ``ucx://`` puts land there, in device memory."""
    disk_path: str = ""
    """A directory for the disk tier below host memory (empty: no disk tier)."""
    disk_size: int = 0
    """Bytes of segments the disk tier keeps at most (needed with ``disk_path``)."""
    prefault_memory: bool = True
    """Map host memory's pages when the node starts, on a thread of its own, so puts do not
    pay a page fault per page they first write (``kvstore.core.arena.populate``); not with
    ``transport="ucx"``, whose registration of the arena maps it for RDMA."""
    huge_pages: bool = True
    """Back host memory with transparent huge pages where the kernel has them (a ``ucx://``
    WRITE or READ between processes of one host takes 0.6x / 0.55x the time with 2 MiB
    pages, ``kvstore.core.arena.host_memory``); not where CUDA pins host memory. False
    advises against them (4 KiB pages even where the kernel's mode is ``always``)."""
    disk_compress: str = "auto"
    """lz4 on the disk tier: ``auto`` where the measured disk and lz4 speeds say reads get
    faster, ``lz4`` always, ``off`` never (``kvstore/node/disk_lz4.py``)."""
    disk_direct: bool | None = None
    """``O_DIRECT`` for the disk tier: None uses it where the file system takes it."""
    gpu_device: str = "cuda"
    """The GPU tier's torch device (tests run the same code on ``"cpu"``)."""
    transport: str = "tcp"
    io_timeout_s: float = 30.0
    """Deadline of each step of a data-plane exchange (one header, one payload)."""
    scrub_bytes: int = MAX_PENDING_BYTES
    """``ucx://`` chunk bytes whose checksum may wait for the scrub after the ack (their
    headers are checked before it); 0: every byte is checked before the ack."""
    max_object_bytes: int = 64 * 2**20
    max_hold_s: float = 600.0
    sweep_s: float = 0.5
    max_connections: int = 1024
    """Data-port connections served at once (lowered at start to fit the file descriptor
    limit, after raising its soft value toward the hard one). One more displaces a
    connection that sent nothing within ``header_timeout_s`` of connecting, or is refused
    with a ``capacity`` error frame: its client raises CapacityError naming the limit."""
    idle_timeout_s: float = 60.0
    """A connection that carries no request for this long is closed. Client pools retire a
    connection after 30 s and dial anew when the node closed one (``kvclient.pool``)."""
    header_timeout_s: float = 5.0
    """Once a frame's first byte has arrived, its whole prefix must arrive within this long,
    else the connection is closed: a trickle cannot hold one (the largest, ~370 KB, takes
    3 ms at 1 Gbit/s)."""
    token: str = ""
    """The cluster secret (``--auth-file``): sent with every master call, and the root of
    the data port's tickets (:mod:`kvstore.dataplane.handshake`: every connection then
    authenticates at its start); empty: none, the data port serves every connection."""
    data_tls: ssl.SSLContext | None = None
    """With a server context (``--data-tls``: the node's ``--tls-cert``/``--tls-key``), the
    data port speaks ``tls://`` only (:mod:`kvstore.transport.tls`)."""
    tls: TlsFiles | None = None
    """TLS to the master (``--tls-ca``, and ``--tls-cert``/``--tls-key`` as the node's
    client certificate); None: plaintext."""
    register_wait_s: float = 60.0
    """How long a starting node waits for its master to answer (it may start after the
    node, or be restarting) and for an older live registration of its id (its own, before
    a restart) to end, before it gives up with the master's error."""
    max_header_bytes: int = 512 * 2**10
    """Longest frame header read. The largest request, a put naming 4096 chunks, measured
    337 KiB (a 126-layer, TP-8 namespace) and 364 KiB with every field at its widest."""

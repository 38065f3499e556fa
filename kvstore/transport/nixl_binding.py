"""The ``nixl_cu12`` binding at arm's length: importing it lazily, memory segments,
translating its exceptions, and reading an agent's name from its metadata (see
:mod:`kvstore.transport.nixl`)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import struct
import sys
from collections.abc import Iterator
from typing import Any

from kvstore.errors import (
    KVStoreError,
    PeerDisconnected,
    ProtocolError,
    TransportError,
    UnknownScheme,
)

__all__ = [
    "NAME_MAX",
    "agent_name_of",
    "import_bindings",
    "segment",
    "translate",
    "translating",
]

NAME_MAX = 256
"""Longest agent name NIXL metadata carries."""
_MD_PREFIX = b"nixlSerDes|Agent"


def translate(b: Any, exc: BaseException, what: str) -> BaseException:
    """NIXL's exception as kvstore's (the caller raises it ``from exc``); ours, and
    non-``Exception`` ones (cancellation, interrupts), are returned as they are."""
    if isinstance(exc, KVStoreError) or not isinstance(exc, Exception):
        return exc
    if isinstance(exc, b.nixlRemoteDisconnectError):
        return PeerDisconnected(f"{what}: the peer disconnected")
    if isinstance(exc, (b.nixlMismatchError, b.nixlInvalidParamError)):
        return ProtocolError(f"{what}: NIXL rejected it ({exc})")
    if isinstance(exc, b.nixlNotFoundError):
        return ProtocolError(f"{what}: spans are not inside memory the peer registered")
    return TransportError(f"{what}: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def translating(b: Any, what: str) -> Iterator[None]:
    """Map NIXL's exceptions onto kvstore's tree (``raise ... from``); ours pass through."""
    try:
        yield
    except Exception as exc:
        translated = translate(b, exc, what)
        if translated is exc:
            raise
        raise translated from exc


# ---- pure helpers -----------------------------------------------------------------------


def import_bindings() -> Any:
    if "nixl_cu12._bindings" not in sys.modules:
        _load_system_libnl_apart()
    try:
        return importlib.import_module("nixl_cu12._bindings")
    except (ImportError, OSError) as exc:
        raise UnknownScheme(f"ucx:// needs nixl-cu12: {exc}") from exc


SYSTEM_LIBNL_ROUTE = "libnl-route-3.so.200"
"""The soname of the system's ``libnl-route-3``, which the system's ``libibverbs`` needs."""


def _load_system_libnl_apart() -> None:
    """Load the system's ``libnl-route-3`` (where installed) bound to itself, before NIXL.

    The ``nixl-cu12`` wheel carries its own ``libibverbs``, ``libnl-3`` and
    ``libnl-route-3`` (renamed copies), and UCX loads its modules into the process's global
    symbol scope. On a host with RDMA providers installed (Debian's ``ibverbs-providers``:
    every RDMA host), that ``libibverbs`` loads the system's providers, which bring the
    system's ``libibverbs`` and ``libnl-route-3``. That ``libnl-route-3`` then binds its own
    calls to the wheel's copy, found first in the global scope: its start-up registration
    of traffic-control operations is refused there (the wheel's copy holds operations of
    the same kinds), and at exit its unregistration unlinks operations that were never
    linked, so every process that created a UCX backend ended with ``SIGSEGV`` in
    ``rtnl_tc_unregister`` from ``_dl_fini`` (status 139), after its work. Loaded first with
    ``RTLD_DEEPBIND``, the system's copy binds to itself and its own ``libnl-3``, each copy
    keeps its own registrations, and the process ends as it should: an engine that embeds
    ``kvclient`` must not crash at exit. A host without the library has nothing to do."""
    flags = os.RTLD_NOW | os.RTLD_LOCAL | getattr(os, "RTLD_DEEPBIND", 0)
    with contextlib.suppress(OSError):
        ctypes.CDLL(SYSTEM_LIBNL_ROUTE, mode=flags)


def segment(bindings: Any, mem: str) -> Any:
    return bindings.DRAM_SEG if mem == "DRAM" else bindings.VRAM_SEG


def agent_name_of(metadata: bytes) -> str | None:
    """The agent name inside NIXL metadata (``nixlSerDes|Agent`` + u64 length + name), or
    None if the layout is not the one NIXL 1.x writes."""
    head = len(_MD_PREFIX)
    if not metadata.startswith(_MD_PREFIX) or len(metadata) < head + 8:
        return None
    (size,) = struct.unpack_from("<Q", metadata, head)
    if not 0 < size <= NAME_MAX or len(metadata) < head + 8 + size:
        return None
    try:
        return metadata[head + 8 : head + 8 + size].decode()
    except UnicodeDecodeError:
        return None

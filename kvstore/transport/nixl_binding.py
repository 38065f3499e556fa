"""The ``nixl_cu12`` binding at arm's length: importing it lazily, memory segments,
translating its exceptions, and reading an agent's name from its metadata (see
:mod:`kvstore.transport.nixl`)."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import struct
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

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
    "end_process",
    "exit_process",
    "import_bindings",
    "loaded",
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
    try:
        return importlib.import_module("nixl_cu12._bindings")
    except (ImportError, OSError) as exc:
        raise UnknownScheme(f"ucx:// needs nixl-cu12: {exc}") from exc


def loaded() -> bool:
    """Whether this process has loaded the binding (and with it UCX and its libraries)."""
    return "nixl_cu12._bindings" in sys.modules


def end_process(code: int) -> NoReturn:
    """End the process with status ``code`` once it has shut down in order: Python's exit
    handlers run and the standard streams are flushed, but not the C libraries'
    destructors (``os._exit``).

    Why: the ``nixl-cu12`` wheel carries its own ``libibverbs`` and ``libnl-route-3``. On a
    host with RDMA providers installed (Debian's ``ibverbs-providers``: every RDMA host),
    that ``libibverbs`` loads the system's providers, which bring the system's
    ``libnl-route-3``; at exit the two copies' destructors crash the process
    (``SIGSEGV`` in ``rtnl_tc_unregister``, from ``_dl_fini``) after it has stopped
    cleanly, so every ``ucx://`` node ended with status 139. Nothing is left for those
    destructors to do by then."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def exit_process(status: int) -> NoReturn:
    """End the process with ``status``: through :func:`end_process` once the binding is
    loaded, else as ``sys.exit`` does."""
    if loaded():
        end_process(status)
    sys.exit(status)


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

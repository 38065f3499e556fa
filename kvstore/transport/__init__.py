"""Data plane transport: framed connections chosen by address scheme.

::

    from kvstore.transport import connect, listen

    async def serve(conn):                     # one task per accepted connection
        while True:
            frame = await conn.recv_header()
            ...

    async with listen("tcp://127.0.0.1:0", serve) as listener:
        conn = await connect(listener.address, timeout=5)
        await conn.send({"op": "get"}, [payload])

The interface (:class:`Connection`, :class:`Listener`) is in :mod:`.base`, the wire format
in :mod:`.framing`. Backends are modules named in :data:`BACKENDS`, imported on first use;
each exposes a ``BACKEND`` object (:class:`~kvstore.transport.base.Backend`). Adding a
scheme is one entry in that dict.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstore.errors import InvalidArgument, UnknownScheme
from kvstore.transport.base import (
    DEFAULT_MAX_CONNECTIONS,
    Backend,
    Connection,
    Handler,
    Listener,
    Refusal,
    as_byte_view,
)
from kvstore.transport.framing import DEFAULT_LIMITS, Frame, FrameLimits

__all__ = [
    "BACKENDS",
    "Backend",
    "Connection",
    "Frame",
    "FrameLimits",
    "Handler",
    "Listener",
    "Refusal",
    "as_byte_view",
    "connect",
    "get_backend",
    "listen",
    "scheme_of",
]

BACKENDS: dict[str, str] = {
    "tcp": "kvstore.transport.tcp",
    "tls": "kvstore.transport.tls",
    "inproc": "kvstore.transport.inproc",
}
"""Address scheme → module exposing ``BACKEND``; imported lazily, on first use."""

_loaded: dict[str, Backend] = {}


def scheme_of(uri: str) -> str:
    """The scheme of ``scheme://rest``; raises :class:`~kvstore.errors.UnknownScheme` without
    one (listing the known schemes)."""
    if not isinstance(uri, str):
        raise InvalidArgument(f"an address must be a str, got {type(uri).__name__}")
    scheme, sep, _ = uri.partition("://")
    if not sep or not scheme:
        raise UnknownScheme(f"address {uri!r} has no scheme; known: {_known()}")
    return scheme.lower()


def get_backend(scheme: str) -> Backend:
    """The backend for ``scheme``, importing its module on first use.

    Raises :class:`~kvstore.errors.UnknownScheme` (listing the known schemes) when none is
    registered, or when its module cannot be imported (e.g. an optional dependency missing).
    """
    backend = _loaded.get(scheme)
    if backend is not None:
        return backend
    path = BACKENDS.get(scheme)
    if path is None:
        raise UnknownScheme(f"no transport for {scheme}://; known: {_known()}")
    try:
        module = importlib.import_module(path)
    except ImportError as exc:
        raise UnknownScheme(f"transport {scheme}:// is unavailable: {exc}") from exc
    backend = module.BACKEND
    _loaded[scheme] = backend
    return backend


async def connect(
    uri: str,
    timeout: float | None = 10.0,
    *,
    limits: FrameLimits = DEFAULT_LIMITS,
    **options: Any,
) -> Connection:
    """Open a connection to ``uri`` (e.g. ``tcp://10.0.0.7:50052``).

    Blocks up to ``timeout`` seconds (resolution and connect). Raises
    :class:`~kvstore.errors.UnknownScheme`, :class:`~kvstore.errors.Unreachable` (refused,
    unresolvable, nothing listening), :class:`~kvstore.errors.KVTimeout`, or
    :class:`~kvstore.errors.InvalidArgument` (malformed address, unknown backend option).
    """
    backend = get_backend(scheme_of(uri))
    return await backend.connect(uri, timeout=timeout, limits=limits, **options)


def listen(
    uri: str,
    handler: Handler,
    *,
    limits: FrameLimits = DEFAULT_LIMITS,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    idle_timeout: float | None = None,
    header_timeout: float | None = None,
    refusal: Refusal | None = None,
    **options: Any,
) -> Listener:
    """Build an unstarted listener on ``uri`` running ``handler(conn)`` per connection.

    ``idle_timeout``, ``header_timeout`` (seconds, None: off) and ``refusal`` guard it
    against peers that hold connections without using them (see
    :class:`~kvstore.transport.base.Listener`). Never blocks; call ``await
    listener.start()`` (or ``async with``) to bind. Raises
    :class:`~kvstore.errors.UnknownScheme` or :class:`~kvstore.errors.InvalidArgument`.
    """
    backend = get_backend(scheme_of(uri))
    return backend.listener(
        uri,
        handler,
        limits=limits,
        max_connections=max_connections,
        idle_timeout=idle_timeout,
        header_timeout=header_timeout,
        refusal=refusal,
        **options,
    )


def _known() -> str:
    return ", ".join(f"{scheme}://" for scheme in sorted(BACKENDS))

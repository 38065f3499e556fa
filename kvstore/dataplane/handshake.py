"""Who is on the other end of a data-port connection: tickets and a challenge-response.

A node started with an auth file (``--auth-file``, the cluster secret) serves a connection
only after it authenticated, once, at its start; without one it serves every connection as
before (the loopback quick start). No secret ever crosses the data port.

**Tickets.** Nodes hold the cluster secret, not the tenants' tokens. A client asks a
master for a ticket (``DataTicket``, itself authenticated by the client's token): the claims
``{v, role, tenant, exp, jti}`` as compact JSON (``jti``: 8 random bytes, so every ticket
has a key of its own), and its key, ``HMAC-SHA256(root, claims)``
where ``root = HMAC-SHA256(cluster_secret, "kvstore data ticket v1")``. Any holder of the
cluster secret — every node, every master — recomputes the key from the claims, so a node
checks a ticket without a call to anyone, and a ticket whose claims were changed has
another key. A ticket expires (``exp``, Unix seconds, :data:`TICKET_TTL_S` after issue; a
node allows :data:`CLOCK_SKEW_S` of clock difference); clients fetch a new one at half
life. Nodes issue tickets to themselves (role ``node``, e.g. for the copies of a drain).

**The exchange** (the client speaks first, as in every exchange)::

    C: Hello{op: hello, ticket: <claims hex>, nonce: <16 bytes hex>}
    N: Challenge{op: challenge, nonce: <16 bytes hex>,
                 proof: HMAC(key, "node" | client nonce | node nonce)}
    C: Proof{op: proof, mac: HMAC(key, "peer" | node nonce | client nonce)}
       then, without waiting, its first request.

The client checks the node's proof before it sends anything else: a listener that holds
neither the cluster secret nor this very ticket (each has its own key: ``jti``) learns
nothing, not even a put's header. What follows the handshake is not bound to it: an active
relay between client and node is stopped only by ``tls://`` (:mod:`kvstore.transport.tls`).
The node checks the client's
mac; on any failure it answers ``Error{code: unauthorized}`` and closes, so the client's
first request raises :class:`~kvstore.errors.Unauthorized`. Fresh nonces on both sides: a
recorded exchange cannot be replayed, against either side. The connection then carries the
ticket's role and tenant; a request the role may not make (:data:`DATA_ROLES`) is answered
``Error{code: forbidden}`` (:class:`~kvstore.errors.PermissionDenied`) and the connection
serves on. Imports neither torch nor NIXL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from kvstore.dataplane.messages import Error, Message, expect
from kvstore.errors import (
    InvalidArgument,
    KVStoreError,
    PermissionDenied,
    ProtocolError,
    Unauthorized,
)
from kvstore.transport import connect, scheme_of
from kvstore.transport.base import Connection, with_timeout

__all__ = [
    "CLOCK_SKEW_S",
    "DATA_ROLES",
    "DRAIN_BYTES",
    "OPEN",
    "TICKET_TTL_S",
    "Challenge",
    "Hello",
    "Peer",
    "Proof",
    "RoleForbidden",
    "Ticket",
    "TicketSource",
    "accept",
    "authenticate",
    "check_allowed",
    "dial",
    "prove",
    "ticket_root",
]

TICKET_TTL_S = 3600.0
"""How long a ticket a master or node issues is valid."""
CLOCK_SKEW_S = 60.0
"""How far past its ``exp`` a node still takes a ticket (clocks of master and node differ)."""
MAX_TICKET_BYTES = 512
"""Bound on a ticket's claims (a tenant name is at most 128 characters)."""
NONCE_BYTES = 16
MAX_EXP = 2**40
"""Largest ``exp`` a ticket may claim (a far-future Unix time; keeps the arithmetic on it
exact and bounded)."""
ROLES = ("node", "client", "admin")
DATA_ROLES: dict[str, frozenset[str]] = {"evict": frozenset({"node", "admin"})}
"""Requests only some roles may make on a data port; every other request is open to all
three (a client's puts, reads, holds, objects, reports and the node's stats)."""


def ticket_root(cluster_secret: str) -> bytes:
    """The key every ticket key derives from; no ticket key reveals it."""
    return hmac.digest(cluster_secret.encode(), b"kvstore data ticket v1", "sha256")


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, b"|".join(parts), "sha256")


@dataclass(frozen=True)
class Ticket:
    """A data-port credential: the claims (sent in the hello) and their key (never sent)."""

    claims: bytes
    key: bytes
    role: str
    tenant: str
    expires: float
    """Unix seconds."""

    @classmethod
    def issue(
        cls, root: bytes, role: str, tenant: str = "", *, ttl_s: float = TICKET_TTL_S,
        now: float | None = None,
    ) -> Ticket:  # fmt: skip
        """A ticket for ``role`` (and ``tenant``) signed under ``root``."""
        if role not in ROLES:
            raise InvalidArgument(f"unknown role {role!r}")
        exp = int((time.time() if now is None else now) + ttl_s)
        # jti: each ticket its own key, so that no two tokens (or two fetches) share one
        body = {"v": 1, "role": role, "tenant": tenant, "exp": exp, "jti": os.urandom(8).hex()}
        claims = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
        if len(claims) > MAX_TICKET_BYTES:
            raise InvalidArgument(f"tenant name too long for a ticket: {tenant[:40]!r}…")
        return cls(claims, _mac(root, claims), role, tenant, float(exp))

    @classmethod
    def verify(cls, root: bytes, claims: bytes, now: float | None = None) -> Ticket:
        """The ticket ``claims`` stand for under ``root``. Raises :class:`Unauthorized` for
        malformed or expired claims (a forged claim is caught later: its key differs)."""
        if len(claims) > MAX_TICKET_BYTES:
            raise Unauthorized(f"ticket longer than {MAX_TICKET_BYTES} bytes")
        try:
            body = json.loads(claims)
        except (UnicodeDecodeError, ValueError):
            raise Unauthorized("ticket is not JSON") from None
        if (
            not isinstance(body, dict)
            or body.get("v") != 1
            or body.get("role") not in ROLES
            or not isinstance(body.get("tenant"), str)
            or type(body.get("exp")) is not int
            or not 0 < body["exp"] < MAX_EXP
            or not isinstance(body.get("jti", ""), str)
        ):
            raise Unauthorized("malformed ticket claims")
        if body["exp"] + CLOCK_SKEW_S < (time.time() if now is None else now):
            raise Unauthorized("ticket expired: fetch a new one from a master")
        return cls(claims, _mac(root, claims), body["role"], body["tenant"], float(body["exp"]))

    def stale(self, ttl_s: float = TICKET_TTL_S, now: float | None = None) -> bool:
        """Past half its life: time to fetch the next one."""
        return (time.time() if now is None else now) > self.expires - ttl_s / 2


@dataclass(frozen=True)
class Peer:
    """Who a node's connection speaks for once authenticated."""

    role: str
    tenant: str = ""


OPEN = Peer("admin")
"""A connection to a node without secrets: everything is allowed (the loopback quick start)."""


class RoleForbidden(PermissionDenied):
    """A data-port request the connection's role may not make (:func:`check_allowed`); a
    node answers only this ``forbidden`` and serves on, not a PermissionDenied its own
    master call raised."""


def check_allowed(peer: Peer, op: str) -> None:
    """Raise :class:`RoleForbidden` if ``peer``'s role may not make request ``op``."""
    roles = DATA_ROLES.get(op)
    if roles is not None and peer.role not in roles:
        raise RoleForbidden(f"{op}: not allowed for role {peer.role}")


# ----------------------------------------------------------------------------- messages


def _hex(header: dict[str, Any], name: str, size: int | None = None) -> bytes:
    value = header.get(name)
    if not isinstance(value, str) or len(value) > 2 * MAX_TICKET_BYTES:
        raise ProtocolError(f"{name}: expected a hex string")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise ProtocolError(f"{name}: not hex") from None
    if size is not None and len(raw) != size:
        raise ProtocolError(f"{name}: expected {size} bytes, got {len(raw)}")
    return raw


@dataclass(frozen=True)
class Hello(Message):
    OP: ClassVar[str] = "hello"
    claims: bytes
    nonce: bytes

    def header(self) -> dict[str, Any]:
        return {"op": "hello", "ticket": self.claims.hex(), "nonce": self.nonce.hex()}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_hex(header, "ticket"), _hex(header, "nonce", NONCE_BYTES))


@dataclass(frozen=True)
class Challenge(Message):
    OP: ClassVar[str] = "challenge"
    nonce: bytes
    proof: bytes

    def header(self) -> dict[str, Any]:
        return {"op": "challenge", "nonce": self.nonce.hex(), "proof": self.proof.hex()}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_hex(header, "nonce", NONCE_BYTES), _hex(header, "proof", 32))


@dataclass(frozen=True)
class Proof(Message):
    OP: ClassVar[str] = "proof"
    mac: bytes

    def header(self) -> dict[str, Any]:
        return {"op": "proof", "mac": self.mac.hex()}

    @classmethod
    def parse(cls, header: dict[str, Any]) -> Self:
        return cls(_hex(header, "mac", 32))


# ----------------------------------------------------------------------------- the exchange


async def prove(conn: Connection, ticket: Ticket, timeout: float) -> None:
    """The client's side, on a fresh connection: hello, check the node's proof, send ours.

    Raises :class:`Unauthorized` when the node cannot prove the ticket's key (or does not
    authenticate at all), and the transport's errors; the caller closes ``conn``.
    """
    mine = os.urandom(NONCE_BYTES)
    await conn.send(Hello(ticket.claims, mine).header(), timeout=timeout)
    frame = await conn.recv_header(timeout=timeout)
    try:
        challenge = expect(frame.header, Challenge)
    except ProtocolError as exc:
        raise Unauthorized(f"node {conn.peer} does not authenticate connections: {exc}") from None
    expected = _mac(ticket.key, b"node", mine, challenge.nonce)
    if not hmac.compare_digest(expected, challenge.proof):
        raise Unauthorized(
            f"node {conn.peer} could not prove the cluster secret (a wrong proof of the key)"
        )
    await conn.send(Proof(_mac(ticket.key, b"peer", challenge.nonce, mine)).header(),
                    timeout=timeout)  # fmt: skip


DRAIN_BYTES = 64 << 20
"""An unauthenticated frame's payload the node still reads (and drops) before it refuses,
so the peer's send completes and it gets the refusal; a larger one is refused unread."""


async def accept(
    conn: Connection, root: bytes, timeout: float, now: Callable[[], float] = time.time
) -> Peer:
    """The node's side: the first frame must be a hello with a valid ticket, then a proof
    of its key. Returns the peer; raises :class:`Unauthorized` (after answering it, so the
    client learns why) or the transport's errors. The caller closes ``conn`` on a raise."""
    frame = await conn.recv_header(timeout=timeout)
    try:
        if frame.sizes:
            raise Unauthorized("authenticate first (hello), then send payloads")
        if frame.header.get("op") != "hello":
            raise Unauthorized(
                f"this node authenticates connections: the first message must be a hello "
                f"with a ticket, got {str(frame.header.get('op'))[:40]!r}"
            )
        try:
            hello = Hello.parse(frame.header)
        except ProtocolError as exc:
            raise Unauthorized(f"malformed hello: {exc}") from None
        ticket = Ticket.verify(root, hello.claims, now())
        mine = os.urandom(NONCE_BYTES)
        proof = _mac(ticket.key, b"node", hello.nonce, mine)
        await conn.send(Challenge(mine, proof).header(), timeout=timeout)
        frame = await conn.recv_header(timeout=timeout)
        if frame.sizes or frame.header.get("op") != "proof":
            raise Unauthorized("expected the proof of the ticket's key")
        try:
            mac = Proof.parse(frame.header).mac
        except ProtocolError as exc:
            raise Unauthorized(f"malformed proof: {exc}") from None
        if not hmac.compare_digest(mac, _mac(ticket.key, b"peer", mine, hello.nonce)):
            raise Unauthorized("the proof does not match the ticket (forged or from another pool)")
    except Unauthorized as exc:
        if frame.sizes and sum(frame.sizes) <= DRAIN_BYTES:
            # A peer still sending a payload it sent unauthenticated would get a broken
            # pipe, not this answer: take the payload (dropped, bounded) so it reads why.
            with contextlib.suppress(KVStoreError):
                await conn.discard_payload(timeout)
        await conn.send(Error.of(exc).header(), timeout=timeout)
        raise
    return Peer(ticket.role, ticket.tenant)


# ----------------------------------------------------------------------------- ticket sources


class TicketSource:
    """Hands out a valid ticket: issued under ``root`` (a node's own), or from ``fetch`` (a
    client's: a master's ``DataTicket``). A fetched ticket past half life is still handed
    out while one fetch of the next runs in the background, so a master that is slow or
    away delays no dial while the ticket lasts; only a client without a valid ticket waits
    for the fetch, at most the dial's timeout. "No ticket" (a master without an auth file,
    or one too old to issue tickets) is remembered for :data:`NO_TICKET_S`."""

    NO_TICKET_S = 30.0

    def __init__(
        self,
        fetch: Callable[[], Awaitable[Ticket | None]] | None = None,
        *,
        root: bytes | None = None,
        role: str = "node",
    ) -> None:
        if (fetch is None) == (root is None):
            raise InvalidArgument("TicketSource takes fetch or root, not both")
        self._fetch = fetch
        self._root = root
        self._role = role
        self._ticket: Ticket | None = None
        self._none_until = 0.0
        self._fetching: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    @classmethod
    def of_secret(cls, cluster_secret: str, role: str = "node") -> TicketSource:
        """A node's own tickets (it holds the cluster secret)."""
        return cls(root=ticket_root(cluster_secret), role=role)

    async def ticket(self, timeout: float | None = None) -> Ticket | None:
        """The current ticket (None: the pool does not authenticate). Raises what the
        fetch raised, or KVTimeout past ``timeout``, when no valid ticket is at hand."""
        now = time.time()
        if self._root is not None:
            if self._ticket is None or self._ticket.stale(now=now):
                self._ticket = Ticket.issue(self._root, self._role, now=now)
            return self._ticket
        held = self._ticket
        if held is not None and not held.stale(now=now):
            return held
        if held is None and time.monotonic() < self._none_until:
            return None
        if self._fetching is None or self._fetching.done():
            self._fetching = asyncio.get_running_loop().create_task(self._fetch_next())
        if held is not None and held.expires > now:  # valid still: the next comes meanwhile
            return held
        await with_timeout(asyncio.shield(self._fetching), timeout, "fetch a data ticket")
        got = self._ticket
        if self._error is not None and (got is None or got is held):
            raise self._error  # (nothing fetched; what is held has expired)
        return got

    async def _fetch_next(self) -> None:
        assert self._fetch is not None
        try:
            got = await self._fetch()
        except ProtocolError:  # a master too old to answer DataTicket: no tickets there
            got = None
        except KVStoreError as exc:
            self._error = exc
            return
        self._error = None
        self._ticket = got
        if got is None:
            self._none_until = time.monotonic() + self.NO_TICKET_S


async def authenticate(conn: Connection, source: TicketSource | None, timeout: float) -> None:
    """Run the client's side on ``conn`` when ``source`` has a ticket (else nothing)."""
    ticket = await source.ticket(timeout) if source is not None else None
    if ticket is not None:
        await prove(conn, ticket, timeout)


async def dial(
    uri: str,
    timeout: float,
    tickets: TicketSource | None,
    ssl_context: ssl.SSLContext | None = None,
) -> Connection:
    """A new connection to ``uri``, authenticated when ``tickets`` has a ticket; a
    ``tls://`` node is verified with ``ssl_context`` (None: the system's roots). Raises what
    ``connect`` raises, and :class:`~kvstore.errors.Unauthorized` (the connection closed)."""
    if ssl_context is not None and scheme_of(uri) == "tls":
        conn = await connect(uri, timeout=timeout, ssl_context=ssl_context)
    else:
        conn = await connect(uri, timeout=timeout)
    try:
        await authenticate(conn, tickets, timeout)
    except BaseException:
        await conn.close()
        raise
    return conn

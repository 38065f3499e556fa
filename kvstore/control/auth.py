"""Who may call which master method: identities from an auth file, tokens in call metadata.

Three roles. ``node``: the cluster secret, shared by the pool's storage nodes (Register,
Heartbeat, Commit, Deregister, and what a draining node asks: Nodes, Lookup, Drain).
``client``: a tenant's token (lookups, matches, watches, aborts, objects, routing, events).
``admin``: an operator's token (everything a client may, plus Drain).

The auth file (``--auth-file PATH``, TOML, readable by its owner only)::

    cluster_secret = "…"            # nodes; at least 16 characters
    [[token]]
    token = "…"                     # at least 16 characters
    role = "client"                 # client | admin
    tenant = "team-a"               # clients: the tenant the token speaks for
    name = "engine-pool-1"          # for logs
    [[tenant]]                      # optional: a tenant's byte quota on the pool
    name = "team-a"
    quota = "40GiB"

A node's file may hold only ``cluster_secret``. A tenant's quota is what it keeps under
pressure: beyond it, its own blocks are evicted first (the master tells each node its
share, :meth:`kvstore.core.slots.SlotTable.set_quotas`). A caller sends its token as gRPC metadata
``authorization: Bearer TOKEN`` on every call; :class:`AuthInterceptor` answers a call
without a known token UNAUTHENTICATED and one whose role may not call the method
PERMISSION_DENIED, before the handler runs. Tokens are compared by their SHA-256 digests
(the file's tokens are hashed once at load), so no lookup takes longer for a closer guess.

Clients find their token in ``token=`` arguments, else ``$KVSTORE_TOKEN``, else the file
``$KVSTORE_TOKEN_FILE`` names (:func:`token_from_env`); never on a command line, where
``ps`` shows it.

The data ports authenticate with tickets a master issues (``DataTicket``) under the cluster
secret: :mod:`kvstore.dataplane.handshake`. A client's tenant scopes every namespace id
and object key it names, on masters and nodes alike: :mod:`kvstore.core.tenancy`.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tomllib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvstore.core.sizes import parse_size
from kvstore.errors import InvalidArgument

__all__ = [
    "METHOD_ROLES",
    "ROLES",
    "AuthConfig",
    "AuthInterceptor",
    "Identity",
    "bearer",
    "check_token",
    "token_from_env",
]

ROLES = ("node", "client", "admin")
MIN_SECRET_LEN = 16
MAX_TENANT_LEN = 128
"""Longest tenant name (it travels in tickets and in drains' puts)."""
_ALL = frozenset(ROLES)
_USERS = frozenset({"client", "admin"})
METHOD_ROLES: Mapping[str, frozenset[str]] = {
    "Register": frozenset({"node"}),
    "Heartbeat": frozenset({"node"}),
    "Commit": frozenset({"node"}),
    "CommitStream": frozenset({"node"}),
    "Deregister": frozenset({"node"}),
    "Drain": frozenset({"node", "admin"}),  # (a node drains itself on SIGTERM)
    "Nodes": _ALL,
    "Lookup": _ALL,
    "Stats": _ALL,
    "MatchPrefix": _USERS,
    "Watch": _USERS,
    "Abort": _USERS,
    "LookupObject": _USERS,
    "ReportNode": _USERS,
    "Route": _USERS,
    "Events": _USERS,
    "DataTicket": _USERS,
}
"""The roles that may call each method of ``kvstore.v1.Master``; a method not listed is
refused to everyone."""
_PREFIX = "/kvstore.v1.Master/"


@dataclass(frozen=True)
class Identity:
    """Who a token speaks for."""

    role: str
    tenant: str = ""
    name: str = ""


def check_token(token: Any, what: str = "token") -> str:
    """``token`` if gRPC metadata can carry it (printable ASCII, no spaces), else
    InvalidArgument (a secret in a file, a client's token)."""
    if not isinstance(token, str) or any(not 0x21 <= ord(ch) <= 0x7E for ch in token):
        raise InvalidArgument(f"{what} must be printable ASCII without spaces")
    return token


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class AuthConfig:
    """The secrets of one auth file: the cluster secret and the tokens, by digest."""

    cluster_secret: str
    identities: Mapping[bytes, Identity]
    quotas: Mapping[str, int] = field(default_factory=dict)
    """Byte quotas on the pool, by tenant (a tenant not named has none)."""

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AuthConfig:
        """Read and check ``path``. Raises InvalidArgument naming the file and the problem:
        unreadable, readable by others than its owner, not TOML, a secret shorter than 16
        characters, an unknown role, a client token without a tenant, a token twice."""
        p = Path(path)
        try:
            mode = p.stat().st_mode
            raw = p.read_bytes()
        except OSError as exc:
            raise InvalidArgument(f"auth file {p}: {exc.strerror or exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise InvalidArgument(
                f"auth file {p} is readable by others (mode {stat.S_IMODE(mode):o}); chmod 600 it"
            )
        try:
            doc = tomllib.loads(raw.decode())
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgument(f"auth file {p} is not TOML: {exc}") from None
        return cls.parse(doc, str(p))

    @classmethod
    def parse(cls, doc: Mapping[str, Any], where: str = "auth file") -> AuthConfig:
        """An :class:`AuthConfig` from a parsed auth file (see the module docstring)."""
        unknown = set(doc) - {"cluster_secret", "token", "tenant"}
        if unknown:
            raise InvalidArgument(f"{where}: unknown keys {sorted(unknown)}")
        secret = doc.get("cluster_secret", "")
        if not isinstance(secret, str) or len(secret) < MIN_SECRET_LEN:
            raise InvalidArgument(
                f"{where}: cluster_secret must be a string of >= {MIN_SECRET_LEN} characters"
            )
        check_token(secret, f"{where}: cluster_secret")
        identities: dict[bytes, Identity] = {_digest(secret): Identity("node", name="node")}
        entries = doc.get("token", [])
        if not isinstance(entries, list):
            raise InvalidArgument(f"{where}: [[token]] entries must be a list of tables")
        for i, entry in enumerate(entries):
            identity, token = _entry(entry, f"{where}: token {i + 1}")
            key = _digest(token)
            if key in identities:
                raise InvalidArgument(f"{where}: token {i + 1} is listed twice (or is the secret)")
            identities[key] = identity
        quotas = _quotas(doc.get("tenant", []), where)
        named = {i.tenant for i in identities.values() if i.tenant}
        stray = sorted(t for t in quotas if t not in named)
        if entries and stray:  # (a typo would leave the tenant meant with no quota at all)
            raise InvalidArgument(
                f"{where}: [[tenant]] {stray[0]!r} has a quota but no token names that tenant"
            )
        return cls(secret, identities, quotas)

    def identify(self, token: str) -> Identity | None:
        """The identity of ``token``, or None."""
        return self.identities.get(_digest(token))

    def caller(self, metadata: Any) -> Identity | None:
        """The identity of the token in a call's ``metadata``, or None."""
        return self.identify(_token_of(metadata))


def _quotas(entries: Any, where: str) -> dict[str, int]:
    if not isinstance(entries, list):
        raise InvalidArgument(f"{where}: [[tenant]] entries must be a list of tables")
    quotas: dict[str, int] = {}
    for i, entry in enumerate(entries):
        at = f"{where}: tenant {i + 1}"
        if not isinstance(entry, dict) or set(entry) != {"name", "quota"}:
            raise InvalidArgument(f"{at}: a table of name and quota")
        name, quota = entry["name"], entry["quota"]
        if (
            not isinstance(name, str)
            or not name.strip()
            or len(name) > MAX_TENANT_LEN
            or name in quotas
        ):
            raise InvalidArgument(f"{at}: name must be a tenant name, listed once")
        try:
            quotas[name] = parse_size(quota)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{at}: quota: {exc}") from None
    return quotas


def _entry(entry: Any, where: str) -> tuple[Identity, str]:
    if not isinstance(entry, dict) or set(entry) - {"token", "role", "tenant", "name"}:
        raise InvalidArgument(f"{where}: a table of token, role, tenant, name")
    token, role = entry.get("token"), entry.get("role")
    tenant, name = entry.get("tenant", ""), entry.get("name", "")
    if not isinstance(token, str) or len(token) < MIN_SECRET_LEN:
        raise InvalidArgument(f"{where}: token must be >= {MIN_SECRET_LEN} characters")
    check_token(token, f"{where}: token")
    if role not in ("client", "admin"):
        raise InvalidArgument(f"{where}: role must be client or admin, got {role!r}")
    if not isinstance(tenant, str) or not isinstance(name, str):
        raise InvalidArgument(f"{where}: tenant and name are strings")
    if role == "client" and not tenant.strip():
        raise InvalidArgument(f"{where}: a client token names its tenant")
    if len(tenant) > MAX_TENANT_LEN:
        raise InvalidArgument(f"{where}: a tenant name is at most {MAX_TENANT_LEN} characters")
    return Identity(role, tenant, name), token


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying ``token`` (empty: none)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def token_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``$KVSTORE_TOKEN``, else the first line of the file ``$KVSTORE_TOKEN_FILE`` names,
    else ``""``. Raises InvalidArgument for a token file that cannot be read."""
    env = os.environ if environ is None else environ
    if env.get("KVSTORE_TOKEN"):
        return env["KVSTORE_TOKEN"].strip()
    path = env.get("KVSTORE_TOKEN_FILE")
    if not path:
        return ""
    return read_token_file(path)


def read_token_file(path: str) -> str:
    """The token in ``path`` (its first line). Raises InvalidArgument if unreadable."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"token file {path}: {exc}") from None
    token = lines[0].strip() if lines else ""
    if not token:
        raise InvalidArgument(f"token file {path} is empty")
    return token


def _token_of(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :]
    return ""


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses, before its handler runs, every call whose token is unknown (UNAUTHENTICATED)
    or whose role may not call the method (PERMISSION_DENIED)."""

    def __init__(self, config: AuthConfig) -> None:
        self.config = config

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        name = method[len(_PREFIX) :] if method.startswith(_PREFIX) else method
        identity = self.config.caller(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if identity is None:
            why = f"{name}: no valid token (metadata authorization: Bearer TOKEN)"
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, why)
        if identity.role not in METHOD_ROLES.get(name, frozenset()):
            why = f"{name}: not allowed for role {identity.role}"
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED, why)
        return handler


def _refusal(handler: Any, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers ``code`` at once."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)
        yield  # pragma: no cover (an async generator that never yields)

    if handler is None:  # an unknown method: gRPC answers UNIMPLEMENTED itself
        return handler  # type: ignore[no-any-return]
    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)  # fmt: skip
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)

"""The index store on Redis (``kvstore master --redis URL``): shared, durable, watchable.

Several masters may share one Redis: every change is one Lua call that checks the node's
epoch and seq inside Redis, so batches never interleave, and every change publishes its
events on one Redis Stream that every master reads, so watches see each other's commits.

Key layout (``P`` is ``namespace_prefix``, ``{ns}``/``{hash}`` lowercase hex)::

    P:b:{ns}:{hash}   hash   node id -> "{epoch}:{mask hex}" (mask as little-endian bytes)
    P:ns:{ns}         set    {hash} of every block with at least one entry
    P:o:{key}         hash   node id -> "{epoch}:{nbytes}:{version}" (``put_object`` values)
    P:n:{id}          hash   epoch, alive, draining, seq (last applied), data_uri, transport,
                             nixl, tiers (JSON), version, host
    P:nb:{id} P:no:{id}  set "{ns}:{hash}" / object keys the node has entries for (purge)
    P:leases          zset   node id -> Redis TIME (ms) of its last register/update_node
    P:dead            zset   node id -> Redis TIME (ms) of its death; at most max_dead_records
    P:epoch           string last epoch handed out: max(last + 1, Redis TIME in ms)
    P:count           hash   blocks, objects: keys with at least one entry
    P:events P:evn    stream of event batches, id "0-{n}", n = INCR P:evn; XADD MAXLEN ~

Lua contract: every script takes ``ARGV[1] = P`` and touches only keys under it (standalone
Redis; not cluster-safe). A mutating script validates first (epoch live, seq new) and
writes only after, so a rejected batch changes nothing; it ends by XADDing one stream
entry whose field ``e`` is a JSON list of ``[kind, ns, hash, node, epoch, mask, reason]``
for the events it caused. Readers find holders live by comparing the entry's epoch with
the node's ``epoch`` while ``alive == "1"``; a dead epoch's entries are purged in steps.

Subscriptions share one ``XREAD BLOCK`` reader task per store. A subscription joins the
reader (whose position is never past the stream's head) first, then one Lua call returns
its snapshot with the position ``n`` it reflects: it keeps exactly the entries after ``n``.
A gap in the ids (the stream was trimmed past the reader) ends the subscriptions that
missed entries with :class:`CapacityError`. Redis must not evict
these keys (``maxmemory-policy noeviction`` or no ``maxmemory``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvstore.control.records import (
    CommitBatch,
    EventKind,
    Holding,
    IndexCounts,
    IndexEvent,
    NodeRecord,
    ObjectHolder,
    Tier,
    chunks_of,
    mask_of,
    mask_to_bytes,
)
from kvstore.errors import (
    CapacityError,
    Closed,
    InvalidArgument,
    KVStoreError,
    KVTimeout,
    StaleEpoch,
    TransportError,
    Unreachable,
)
from kvstore.master.index import BoundedSubscription, IndexStore, Subscription, id_taken

__all__ = ["RedisIndexStore"]

_T = TypeVar("_T")
_MAX_INT = 1 << 53
"""Epochs and seqs travel through Lua doubles: they must stay exact."""

_LUA_PRELUDE = """
local P = ARGV[1]
local function split(v)
  local i = string.find(v, ':', 1, true)
  return string.sub(v, 1, i - 1), string.sub(v, i + 1)
end
local function entry(v)  -- 'epoch:mask' or 'epoch:mask:location' -> epoch, mask, location
  local e, rest = split(v)
  local i = string.find(rest, ':', 1, true)
  if i == nil then return e, rest, '' end
  return e, string.sub(rest, 1, i - 1), string.sub(rest, i + 1)
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local live = {}
local function live_epoch(node)
  local e = live[node]
  if e == nil then
    local r = redis.call('HMGET', P .. ':n:' .. node, 'epoch', 'alive')
    e = (r[1] and r[2] == '1') and r[1] or false
    live[node] = e
  end
  return e
end
local function live_fields(key)
  local all, out = redis.call('HGETALL', key), {}
  for k = 1, #all, 2 do
    if split(all[k + 1]) == live_epoch(all[k]) then
      out[#out + 1] = all[k]
      out[#out + 1] = all[k + 1]
    end
  end
  return out
end
local function hex_or(a, b)
  if #a < #b then a, b = b, a end
  if #b == 0 then return a end
  local out = {}
  for i = 1, #a do
    local x = tonumber(string.sub(a, i, i), 16)
    if i <= #b then x = bit.bor(x, tonumber(string.sub(b, i, i), 16)) end
    out[i] = string.format('%x', x)
  end
  return table.concat(out)
end
local events = {}
local function emit(kind, ns, h, node, epoch, mask, reason, location)
  events[#events + 1] = {kind, ns, h, node, epoch, mask, reason, location or ''}
end
local function flush(maxlen)
  if #events == 0 then return end
  local sk = P .. ':events'
  local n = redis.call('INCR', P .. ':evn')
  local last = redis.call('XREVRANGE', sk, '+', '-', 'COUNT', 1)
  if #last > 0 then
    local s = tonumber(string.match(last[1][1], '%-(%d+)$'))
    if s >= n then n = s + 1; redis.call('SET', P .. ':evn', n) end
  end
  redis.call('XADD', sk, 'MAXLEN', '~', maxlen, '0-' .. string.format('%.0f', n), 'e',
             cjson.encode(events))
end
local function drop_block(bk, ns, h)
  if redis.call('EXISTS', bk) == 0 then
    redis.call('SREM', P .. ':ns:' .. ns, h)
    redis.call('HINCRBY', P .. ':count', 'blocks', -1)
  end
end
"""

_APPLY = """
local node, epoch, seq, maxlen = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local cur = redis.call('HMGET', P .. ':n:' .. node, 'epoch', 'alive', 'seq')
if cur[1] ~= epoch or cur[2] ~= '1' then return {'stale', cur[1] or '', cur[2] or ''} end
if seq <= (tonumber(cur[3]) or 0) then return {'ok', cur[3] or '0'} end
local b = cjson.decode(ARGV[6])
local nb, nob, count, blocks = P .. ':nb:' .. node, P .. ':no:' .. node, P .. ':count', 0
for _, ref in ipairs(b.evicts) do
  local ns, h = ref[1], ref[2]
  local bk = P .. ':b:' .. ns .. ':' .. h
  local old = redis.call('HGET', bk, node)
  if old then
    redis.call('HDEL', bk, node)
    drop_block(bk, ns, h)
    redis.call('SREM', nb, ns .. ':' .. h)
    local oe, om = entry(old)
    if oe == epoch then emit('evict', ns, h, node, epoch, om, '') end
  end
end
for _, add in ipairs(b.adds) do
  local ns, h, m, loc = add[1], add[2], add[3], add[4] or ''
  local bk = P .. ':b:' .. ns .. ':' .. h
  local old, mask = redis.call('HGET', bk, node), m
  if old then
    local oe, om, ol = entry(old)
    if oe == epoch then
      mask = hex_or(m, om)
      if loc == '' then loc = ol end
    end
  end
  local v = epoch .. ':' .. mask
  if loc ~= '' then v = v .. ':' .. loc end
  redis.call('HSET', bk, node, v)
  if not old and redis.call('HLEN', bk) == 1 then
    redis.call('SADD', P .. ':ns:' .. ns, h)
    blocks = blocks + 1
  end
  redis.call('SADD', nb, ns .. ':' .. h)
  emit('commit', ns, h, node, epoch, m, '', loc)
end
if blocks > 0 then redis.call('HINCRBY', count, 'blocks', blocks) end
for _, key in ipairs(b.object_removes) do
  local ok = P .. ':o:' .. key
  if redis.call('HDEL', ok, node) == 1 then
    if redis.call('EXISTS', ok) == 0 then redis.call('HINCRBY', count, 'objects', -1) end
    redis.call('SREM', nob, key)
  end
end
for _, obj in ipairs(b.object_adds) do
  local ok = P .. ':o:' .. obj[1]
  if redis.call('EXISTS', ok) == 0 then redis.call('HINCRBY', count, 'objects', 1) end
  redis.call('HSET', ok, node, epoch .. ':' .. obj[2] .. ':' .. obj[3])
  redis.call('SADD', nob, obj[1])
end
redis.call('HSET', P .. ':n:' .. node, 'seq', ARGV[4])
flush(maxlen)
return {'ok', ARGV[4]}
"""

_REGISTER = """
local node, maxlen, nk = ARGV[2], ARGV[3], P .. ':n:' .. ARGV[2]
local now = now_ms()
local last = tonumber(redis.call('GET', P .. ':epoch') or '0')
local old = redis.call('HMGET', nk, 'epoch', 'alive', 'draining', 'session', 'data_uri')
if old[2] == '1' and old[4] and old[4] ~= '' and old[4] ~= ARGV[11] then
  return {'taken', old[1], old[5]}
end
local es = string.format('%.0f', math.max(last + 1, now))
redis.call('SET', P .. ':epoch', es)
local draining = old[3] or ARGV[10]
redis.call('HSET', nk, 'data_uri', ARGV[4], 'transport', ARGV[5], 'nixl', ARGV[6],
           'tiers', ARGV[7], 'version', ARGV[8], 'host', ARGV[9], 'epoch', es, 'alive', '1',
           'draining', draining, 'seq', '0', 'session', ARGV[11])
redis.call('ZADD', P .. ':leases', now, node)
redis.call('ZREM', P .. ':dead', node)
if old[1] and old[2] == '1' then emit('node_dead', '', '', node, old[1], '', 're-registered') end
flush(maxlen)
return {es, draining}
"""

_UPDATE = """
local node, nk = ARGV[2], P .. ':n:' .. ARGV[2]
if redis.call('HGET', nk, 'epoch') ~= ARGV[3] then return 0 end
if ARGV[4] == '1' then redis.call('HSET', nk, 'tiers', ARGV[5]) end
if ARGV[6] == '1' then redis.call('HSET', nk, 'draining', ARGV[7]) end
redis.call('ZADD', P .. ':leases', now_ms(), node)
if redis.call('HGET', nk, 'draining') == '1' then return 2 end
return 1
"""

_DROP = """
local node, epoch, nk, dead = ARGV[2], ARGV[3], P .. ':n:' .. ARGV[2], P .. ':dead'
local cur = redis.call('HMGET', nk, 'epoch', 'alive')
if cur[1] ~= epoch or cur[2] ~= '1' then return 0 end
redis.call('HSET', nk, 'alive', '0')
redis.call('ZADD', dead, now_ms(), node)
while redis.call('ZCARD', dead) > tonumber(ARGV[6]) do
  local gone = redis.call('ZPOPMIN', dead)[1]
  redis.call('DEL', P .. ':n:' .. gone)
  redis.call('ZREM', P .. ':leases', gone)
end
emit('node_dead', '', '', node, epoch, '', ARGV[4])
flush(ARGV[5])
return 1
"""

_PURGE = """
local node, below, kind = ARGV[2], tonumber(ARGV[3]), ARGV[6]
local setk = P .. ':n' .. kind .. ':' .. node
local r = redis.call('SSCAN', setk, ARGV[4], 'COUNT', ARGV[5])
for _, member in ipairs(r[2]) do
  local key = P .. ':' .. kind .. ':' .. member
  local v = redis.call('HGET', key, node)
  if not v then
    redis.call('SREM', setk, member)
  elseif tonumber((split(v))) < below then
    redis.call('HDEL', key, node)
    redis.call('SREM', setk, member)
    if kind == 'b' then
      local ns, h = split(member)
      drop_block(key, ns, h)
    elseif redis.call('EXISTS', key) == 0 then
      redis.call('HINCRBY', P .. ':count', 'objects', -1)
    end
  end
end
return r[1]
"""

_LOCATE = """
local out, ns = {redis.call('GET', P .. ':evn') or '0'}, ARGV[2]
for _, h in ipairs(cjson.decode(ARGV[3])) do
  out[#out + 1] = live_fields(P .. ':b:' .. ns .. ':' .. h)
end
return cjson.encode(out)
"""

_LOCATE_OBJECT = "return live_fields(P .. ':o:' .. ARGV[2])"

_NODES = """
local out = {}
for _, id in ipairs(redis.call('ZRANGE', P .. ':leases', 0, -1)) do
  out[#out + 1] = {id, redis.call('HGETALL', P .. ':n:' .. id)}
end
return out
"""

_LEASES = """
local out = {tostring(now_ms())}
local r = redis.call('ZRANGE', P .. ':leases', 0, -1, 'WITHSCORES')
for i = 1, #r, 2 do
  local f = redis.call('HMGET', P .. ':n:' .. r[i], 'epoch', 'alive')
  if f[2] == '1' then
    out[#out + 1] = r[i]
    out[#out + 1] = f[1]
    out[#out + 1] = r[i + 1]
  end
end
return out
"""

_ABORT = """
for j = 5, #ARGV do emit('abort', ARGV[3], ARGV[j], '', '0', '', ARGV[4]) end
flush(ARGV[2])
return 1
"""

_VALIDATE = """
local G, bad, n = ARGV[2], nil, {b = 0, o = 0}
local function each(infix, fn)
  local cursor, skip = '0', #P + #infix + 3
  repeat
    local r = redis.call('SCAN', cursor, 'MATCH', G .. ':' .. infix .. ':*', 'COUNT', 1000)
    cursor = r[1]
    for _, k in ipairs(r[2]) do fn(string.sub(k, skip)) end
  until cursor == '0'
end
local function check(ok, what) if not ok and not bad then bad = what end end
for _, kind in ipairs({'b', 'o'}) do
  each(kind, function(s)
    n[kind] = n[kind] + 1
    if kind == 'b' then
      local ns, h = split(s)
      check(redis.call('SISMEMBER', P .. ':ns:' .. ns, h) == 1, 'block ' .. s .. ' not in ns')
    end
    for _, node in ipairs(redis.call('HKEYS', P .. ':' .. kind .. ':' .. s)) do
      local ok = redis.call('SISMEMBER', P .. ':n' .. kind .. ':' .. node, s) == 1
      check(ok, kind .. ' ' .. s .. ' of ' .. node .. ' missing from its n' .. kind .. ' set')
    end
  end)
  each('n' .. kind, function(node)
    for _, m in ipairs(redis.call('SMEMBERS', P .. ':n' .. kind .. ':' .. node)) do
      local ok = redis.call('HEXISTS', P .. ':' .. kind .. ':' .. m, node) == 1
      check(ok, 'n' .. kind .. ' set of ' .. node .. ' lists unheld ' .. m)
    end
  end)
end
each('ns', function(ns)
  for _, h in ipairs(redis.call('SMEMBERS', P .. ':ns:' .. ns)) do
    check(redis.call('EXISTS', P .. ':b:' .. ns .. ':' .. h) == 1, 'ns ' .. ns .. ' lists ' .. h)
  end
end)
local c = redis.call('HMGET', P .. ':count', 'blocks', 'objects')
check(tonumber(c[1] or 0) == n.b and tonumber(c[2] or 0) == n.o, 'counts disagree with keys')
check(redis.call('ZCARD', P .. ':dead') <= tonumber(ARGV[3]), 'too many dead records kept')
return bad or ''
"""


def _hex(raw: bytes) -> str:
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise InvalidArgument(f"ids are bytes, got {type(raw).__name__}")
    return bytes(raw).hex()


def _int_arg(value: int, what: str) -> str:
    if not 0 <= value < _MAX_INT:
        raise InvalidArgument(f"{what} {value} out of range [0, 2**53)")
    return str(value)


def _version_arg(version: int) -> str:
    """An object's version (a writer's clock in ns: past a double's precision, so it goes
    to Lua as a string, never through cjson's numbers)."""
    if not 0 <= version < 1 << 64:
        raise InvalidArgument(f"object version {version} out of range [0, 2**64)")
    return str(version)


def _mask_hex(mask_hex: str) -> int:
    return int.from_bytes(bytes.fromhex(mask_hex), "little")


def _chunks_hex(chunks: Sequence[int]) -> str:
    return mask_to_bytes(mask_of(chunks)).hex()


def _holders(flat: Sequence[str]) -> dict[str, Holding]:
    """``[node, "epoch:mask[:location]", ...]`` -> node id -> Holding."""
    out: dict[str, Holding] = {}
    for i in range(0, len(flat), 2):
        epoch, mask, *location = flat[i + 1].split(":", 2)
        where = bytes.fromhex(location[0]) if location else b""
        out[flat[i]] = Holding(int(epoch), _mask_hex(mask), where)
    return out


def _located(reply: bytes) -> tuple[int, list[dict[str, Holding]]]:
    """The locate script's JSON: the stream position, then each block's live holders
    (cjson writes an empty list as ``{}``, hence the ``or []``)."""
    position, *blocks = json.loads(reply)
    return int(position), [_holders(flat or []) for flat in blocks]


def _event(raw: list[str]) -> IndexEvent:
    kind, ns, block_hash, node, epoch, mask, reason, *location = raw
    ns_id, block, chunks = bytes.fromhex(ns), bytes.fromhex(block_hash), chunks_of(_mask_hex(mask))
    where = bytes.fromhex(location[0]) if location else b""
    return IndexEvent(EventKind(kind), ns_id, block, node, int(epoch), tuple(chunks), reason, where)


def _record(node_id: str, flat: list[bytes]) -> NodeRecord:
    f = {k.decode(): v for k, v in zip(flat[::2], flat[1::2], strict=True)}
    kw: dict[str, Any] = {k: f.get(k, b"").decode() for k in ("data_uri", "transport", "version")}
    kw["host"], kw["nixl_metadata"] = f.get("host", b"").decode(), f.get("nixl", b"")
    kw["tiers"] = tuple(Tier(str(n), int(c), int(u)) for n, c, u in json.loads(f["tiers"]))
    kw["alive"], kw["draining"] = f.get("alive") == b"1", f.get("draining") == b"1"
    kw["session"] = f.get("session", b"")
    return NodeRecord(node_id, epoch=int(f["epoch"]), **kw)


def _tiers_json(tiers: Sequence[Tier]) -> str:
    return json.dumps([[t.name, t.capacity_bytes, t.used_bytes] for t in tiers])


class _RedisSubscription(BoundedSubscription):
    """A bounded queue fed by the store's stream reader; overflow ends it.

    It is registered with the reader before its snapshot is read; until :meth:`begin`
    gives the snapshot's stream position (``start``) it buffers every entry, then keeps
    exactly those after it. ``keys`` are the watched ``(ns hex, hash hex)`` pairs.
    """

    def __init__(
        self, store: RedisIndexStore, maxlen: int, keys: frozenset[tuple[str, str]]
    ) -> None:
        super().__init__(maxlen)
        self.start: int | None = None
        self.keys = keys
        self._store = store

    def begin(self, start: int, snapshot: list[dict[str, Holding]]) -> None:
        """The snapshot reflects entries up to ``start``: drop those buffered so far."""
        self.start, self.snapshot = start, snapshot
        self._queue = deque(item for item in self._queue if item[0] > start)

    def push(self, n: int, event: IndexEvent) -> None:
        """Queue ``event`` of stream entry ``n`` unless the snapshot already covers it."""
        if self.start is not None and n <= self.start:
            return
        self._enqueue(n, event)

    def close(self) -> None:
        """See :meth:`Subscription.close`."""
        super().close()
        self._store._detach(self)

    async def read(self, max_events: int = 256, timeout: float | None = None) -> list[IndexEvent]:
        """See :meth:`Subscription.read`. Time permitting, every event committed before the
        call is queued (or has overflowed the queue) before this returns. Besides the
        interface's errors it raises :class:`Unreachable` / :class:`TransportError` when the
        stream cannot be read for longer than the store's ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        if len(self._queue) < max(1, max_events) and not self.done:
            await self._store._catch_up(self, deadline)
        return await self._take(max_events, deadline, timeout)


class RedisIndexStore(IndexStore):
    """:class:`IndexStore` on Redis >= 5 (``redis.asyncio``); see the module docstring.

    Construction does no I/O; :meth:`start` (or ``async with``) checks that Redis answers;
    :meth:`close` stops the stream reader and closes the pool. Every Redis call is bounded
    by ``timeout_s`` (:class:`KVTimeout`); a refused connection raises :class:`Unreachable`,
    an error reply :class:`TransportError`. ``stream_maxlen`` bounds the event stream (in
    entries, one per batch); ``block_s`` is the reader's ``XREAD BLOCK``; a dead epoch is
    purged ``purge_step`` entries per Lua call; ``max_dead_records`` dead records are kept.
    """

    shares_events = True  # (several masters may apply commits to one Redis)

    def __init__(
        self,
        url: str,
        *,
        namespace_prefix: str = "kv",
        stream_maxlen: int = 10_000,
        timeout_s: float = 5.0,
        block_s: float = 1.0,
        purge_step: int = 512,
        max_dead_records: int = 1024,
        max_connections: int = 64,
        retries: int = 1,
    ) -> None:
        if not namespace_prefix or any(c.isspace() for c in namespace_prefix):
            raise InvalidArgument(f"bad redis key prefix {namespace_prefix!r}")
        if min(stream_maxlen, purge_step, max_dead_records, max_connections - 1) < 1:
            raise InvalidArgument("stream_maxlen, purge_step, max_dead_records must be >= 1")
        if not (timeout_s > 0 and block_s > 0):
            raise InvalidArgument("timeout_s and block_s must be > 0")
        try:
            pool = aioredis.BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=timeout_s,
                socket_timeout=timeout_s + block_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), max(0, retries)),
            )
        except ValueError as exc:
            raise InvalidArgument(f"bad redis URL {url!r}: {exc}") from exc
        self._redis = aioredis.Redis.from_pool(pool)
        self._url = url
        kw = pool.connection_kwargs
        self.where = kw.get("path") or f"{kw.get('host')}:{kw.get('port')}/{kw.get('db', 0)}"
        """Redis as error messages name it (the URL may hold a password)."""
        self.prefix = namespace_prefix
        self._maxlen = str(stream_maxlen)
        self._timeout_s = timeout_s
        self._block_ms = max(1, int(block_s * 1000))
        self._purge_step = str(purge_step)
        self._max_dead = str(max_dead_records)
        self._events_key = f"{namespace_prefix}:events"
        scripts = {"apply": _APPLY, "register": _REGISTER, "update": _UPDATE, "drop": _DROP}
        scripts |= {"purge": _PURGE, "locate": _LOCATE, "abort": _ABORT, "nodes": _NODES}
        scripts["leases"] = _LEASES
        scripts["object"] = _LOCATE_OBJECT
        self._scripts = {
            n: self._redis.register_script(_LUA_PRELUDE + s) for n, s in scripts.items()
        }
        self._subs: set[_RedisSubscription] = set()
        self._watchers: dict[tuple[str, str], set[_RedisSubscription]] = {}
        self._everything: set[_RedisSubscription] = set()  # (subscribe_all's)
        self._pos = 0
        self._reader: asyncio.Task[None] | None = None
        self._advanced = asyncio.Event()
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Check that Redis answers and is >= 5.0 (streams). Raises :class:`Unreachable`,
        :class:`KVTimeout`, :class:`TransportError` (too old), :class:`Closed`."""
        info = await self._call(lambda: self._redis.info("server"))
        version = str(info.get("redis_version", "0"))
        if int(version.split(".")[0]) < 5:
            raise TransportError(f"redis {version} at {self.where} is too old: streams need 5.0")

    async def __aenter__(self) -> RedisIndexStore:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """See :meth:`IndexStore.close`: also stops the stream reader and closes the pool."""
        if self._closed:
            return
        self._closed = True
        for sub in list(self._subs):
            sub.close()
        reader, self._reader = self._reader, None
        # Closing the sockets first ends a blocked XREAD at once: redis-py may hold back a
        # cancellation until the command returns (redis-py #2028, #2579).
        with contextlib.suppress(redis_errors.RedisError, OSError):
            await self._redis.connection_pool.disconnect(inuse_connections=True)
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        self._advance()
        with contextlib.suppress(redis_errors.RedisError, OSError):
            await self._redis.aclose()

    # -- registry -----------------------------------------------------------------------

    async def register_node(self, record: NodeRecord) -> NodeRecord:
        """See :meth:`IndexStore.register_node`. Purges the node's older entries before
        returning."""
        args: list[str | bytes] = [self.prefix, record.node_id, self._maxlen, record.data_uri]
        args += [record.transport, record.nixl_metadata, _tiers_json(record.tiers)]
        args += [record.version, record.host, "1" if record.draining else "0", record.session]
        reply = await self._script("register", args)
        if len(reply) == 3:  # ('taken', epoch, data_uri): a live record of another key
            held = NodeRecord(record.node_id, reply[2].decode(), epoch=int(reply[1]))
            raise id_taken(held)
        epoch, draining = int(reply[0]), reply[1]
        await self._purge(record.node_id, epoch)
        return replace(record, epoch=epoch, alive=True, draining=draining == b"1")

    async def update_node(
        self,
        node_id: str,
        epoch: int,
        *,
        tiers: Sequence[Tier] | None = None,
        draining: bool | None = None,
    ) -> bool | None:
        """See :meth:`IndexStore.update_node`; also refreshes the node's Redis-TIME lease."""
        args = [self.prefix, node_id, _int_arg(epoch, "epoch")]
        args += ["0", ""] if tiers is None else ["1", _tiers_json(tiers)]
        args += ["0", ""] if draining is None else ["1", "1" if draining else "0"]
        done = int(await self._script("update", args))
        return None if done == 0 else done == 2

    async def drop_node(self, node_id: str, epoch: int, reason: str) -> bool:
        """See :meth:`IndexStore.drop_node`. Purges the epoch's entries before returning."""
        args = [self.prefix, node_id, _int_arg(epoch, "epoch"), reason, self._maxlen]
        if not await self._script("drop", [*args, self._max_dead]):
            return False
        await self._purge(node_id, epoch + 1)
        return True

    async def leases(self) -> dict[str, tuple[int, float]]:
        """See :meth:`IndexStore.leases`: ``P:leases`` (Redis TIME of each live node's last
        register or heartbeat, whichever master served it) against Redis TIME now."""
        reply = await self._script("leases", [self.prefix])
        now = float(reply[0])
        rows = reply[1:]
        return {
            rows[i].decode(): (int(rows[i + 1]), max(0.0, (now - float(rows[i + 2])) / 1000))
            for i in range(0, len(rows), 3)
        }

    async def nodes(self) -> list[NodeRecord]:
        """See :meth:`IndexStore.nodes`."""
        rows = await self._script("nodes", [self.prefix])
        records = [_record(node.decode(), flat) for node, flat in rows if flat]
        return sorted(records, key=lambda r: r.node_id)

    # -- index ----------------------------------------------------------------------------

    async def apply(self, batch: CommitBatch) -> int:
        """See :meth:`IndexStore.apply`: one Lua call, checks and writes atomic in Redis."""
        body = {
            "evicts": [[_hex(r.ns_id), _hex(r.block_hash)] for r in batch.evicts],
            "adds": [
                [_hex(a.ns_id), _hex(a.block_hash), _chunks_hex(a.chunks), a.location.hex()]
                for a in batch.adds
            ],
            "object_removes": list(batch.object_removes),
            "object_adds": [
                [o.key, _int_arg(o.nbytes, "nbytes"), _version_arg(o.version)]
                for o in batch.object_adds
            ],
        }
        args = [self.prefix, batch.node_id, _int_arg(batch.epoch, "epoch")]
        args += [_int_arg(batch.seq, "seq"), self._maxlen, json.dumps(body, ensure_ascii=False)]
        reply = await self._script("apply", args)
        if reply[0] == b"stale":
            state = f"at epoch {int(reply[1])}, alive={reply[2] == b'1'}" if reply[1] else "unknown"
            msg = f"node {batch.node_id!r} epoch {batch.epoch} is not live (node {state})"
            raise StaleEpoch(msg)
        return int(reply[1])

    async def locate(self, ns_id: bytes, block_hashes: Sequence[bytes]) -> list[dict[str, Holding]]:
        """See :meth:`IndexStore.locate`: one Lua call."""
        hexes = json.dumps([_hex(h) for h in block_hashes])
        return _located(await self._script("locate", [self.prefix, _hex(ns_id), hexes]))[1]

    async def locate_object(self, key: str) -> list[ObjectHolder]:
        """See :meth:`IndexStore.locate_object`."""
        flat = await self._script("object", [self.prefix, key])
        holders = []
        for i in range(0, len(flat), 2):
            epoch, nbytes, *version = flat[i + 1].split(b":", 2)  # (no version: written before)
            holders.append(ObjectHolder(flat[i].decode(), int(epoch), int(nbytes),
                                        version=int(version[0]) if version else 0))  # fmt: skip
        return sorted(holders, key=lambda h: h.node_id)

    async def counts(self) -> IndexCounts:
        """See :meth:`IndexStore.counts`."""
        blocks, objects = await self._call(
            lambda: self._redis.hmget(f"{self.prefix}:count", "blocks", "objects")
        )
        return IndexCounts(blocks=int(blocks or 0), objects=int(objects or 0))

    async def blocks(
        self, ns_id: bytes, batch: int
    ) -> AsyncIterator[list[tuple[bytes, bytes, dict[str, Holding]]]]:
        """See :meth:`IndexStore.blocks`: SSCAN of each namespace's set of blocks (the
        namespaces by SCAN when ``ns_id`` is empty), each part's live holders by the locate
        script. SSCAN may give a member twice; it gives every member present throughout."""
        if ns_id:
            spaces = [_hex(ns_id)]
        else:
            match = f"{_glob_escape(self.prefix)}:ns:*"
            keys = await self._call(lambda: self._scan_all(match))
            spaces = sorted(k.decode().rsplit(":", 1)[1] for k in keys)
        count = max(1, batch)
        for space in spaces:
            key, cursor = f"{self.prefix}:ns:{space}", 0
            while True:
                sscan = functools.partial(self._redis.sscan, key, cursor, count=count)
                cursor, members = await self._call(sscan)
                hashes = [bytes.fromhex(m if isinstance(m, str) else m.decode()) for m in members]
                raw_ns = bytes.fromhex(space)
                for i in range(0, len(hashes), count):
                    part = hashes[i : i + count]
                    held = await self.locate(raw_ns, part)
                    out = [(raw_ns, h, live) for h, live in zip(part, held, strict=True) if live]
                    if out:
                        yield out
                if int(cursor) == 0:
                    break

    async def _scan_all(self, match: str) -> list[bytes]:
        return [k async for k in self._redis.scan_iter(match=match, count=1000)]

    @contextlib.asynccontextmanager
    async def subscribe_all(self, maxlen: int) -> AsyncIterator[Subscription]:
        """See :meth:`IndexStore.subscribe_all`: every entry the shared reader reads after
        the position it joins at."""
        sub = _RedisSubscription(self, max(1, maxlen), frozenset())
        try:
            sub.begin(await self._attach(sub, everything=True), [])
            yield sub
        finally:
            sub.close()

    # -- events ---------------------------------------------------------------------------

    async def abort(self, ns_id: bytes, block_hashes: Sequence[bytes], reason: str) -> None:
        """See :meth:`IndexStore.abort`: one stream entry for all the blocks."""
        if block_hashes:
            args = [self.prefix, self._maxlen, _hex(ns_id), reason, *map(_hex, block_hashes)]
            await self._script("abort", args)

    @contextlib.asynccontextmanager
    async def subscribe(
        self, ns_id: bytes, block_hashes: Sequence[bytes], maxlen: int
    ) -> AsyncIterator[Subscription]:
        """See :meth:`IndexStore.subscribe`. The subscription joins the shared reader
        (whose position is at most the stream's head) before one Lua call reads the
        snapshot with the stream position it reflects. Raises what Redis calls raise."""
        ns_hex, hexes = _hex(ns_id), [_hex(h) for h in block_hashes]
        sub = _RedisSubscription(self, max(1, maxlen), frozenset((ns_hex, h) for h in hexes))
        try:
            joined = await self._attach(sub)
            reply = await self._script("locate", [self.prefix, ns_hex, json.dumps(hexes)])
            sub.begin(*_located(reply))
            if sub.start is not None and sub.start < joined:
                self._rewind(sub, sub.start)
            yield sub
        finally:
            sub.close()

    # -- test support -----------------------------------------------------------------------

    def validate(self) -> None:
        """Check the keys under the prefix for consistency; raises AssertionError naming the
        broken invariant. **Blocks** on a synchronous connection: tests only."""
        client = redis.Redis.from_url(self._url, socket_timeout=self._timeout_s)
        try:
            args = (self.prefix, _glob_escape(self.prefix), self._max_dead)
            problem = client.eval(_LUA_PRELUDE + _VALIDATE, 0, *args)
        finally:
            client.close()
        if problem:
            raise AssertionError(problem.decode())
        for key, watchers in self._watchers.items():
            if not watchers or not watchers <= self._subs:
                raise AssertionError(f"watchers of {key} inconsistent with subscriptions")

    # -- internals --------------------------------------------------------------------------

    async def _call(self, op: Callable[[], Awaitable[_T]], timeout: float | None = None) -> _T:
        """Run one Redis call under a deadline, translating its errors. ``wait_for`` runs it
        in a task of its own: redis-py can swallow a cancellation (redis-py #2028), which
        must not leak into the caller's task."""
        if self._closed:
            raise Closed("index store is closed")
        limit = self._timeout_s if timeout is None else timeout
        try:
            return await asyncio.wait_for(op(), limit)
        except KVStoreError:
            raise
        except (TimeoutError, redis_errors.TimeoutError) as exc:
            self._raise_closed(exc)
            raise KVTimeout(f"redis at {self.where} did not answer within {limit} s") from exc
        except (redis_errors.ConnectionError, OSError) as exc:
            self._raise_closed(exc)
            raise Unreachable(f"redis at {self.where} unreachable: {exc}") from exc
        except redis_errors.DataError as exc:
            raise InvalidArgument(f"redis refused an argument: {exc}") from exc
        except redis_errors.OutOfMemoryError as exc:
            raise CapacityError(f"redis at {self.where} is out of memory: {exc}") from exc
        except redis_errors.RedisError as exc:
            self._raise_closed(exc)
            raise TransportError(f"redis at {self.where} failed: {exc}") from exc

    def _raise_closed(self, exc: BaseException) -> None:
        if self._closed:
            raise Closed("index store is closed") from exc

    async def _script(self, name: str, args: list[Any]) -> Any:
        script = self._scripts[name]
        return await self._call(lambda: script(args=args))

    async def _purge(self, node_id: str, below_epoch: int) -> None:
        """Delete the node's block and object entries of epochs below ``below_epoch``, in
        steps of ``purge_step`` (reads already ignore them; this frees memory, fixes counts)."""
        for kind in ("b", "o"):
            cursor: Any = "0"
            while True:
                args = [self.prefix, node_id, str(below_epoch), cursor, self._purge_step, kind]
                cursor = await self._script("purge", args)
                if cursor in (b"0", 0, "0"):
                    break

    # -- the shared stream reader -------------------------------------------------------------

    async def _attach(self, sub: _RedisSubscription, *, everything: bool = False) -> int:
        """Register ``sub`` with the reader (for its keys' events, or ``everything``),
        starting an idle reader at the stream's head; returns the reader's position then
        (never past the stream's head)."""
        if self._reader is None:
            head = await self._head()
            if self._reader is None:  # nobody started one while we waited
                self._pos = head
                self._reader = asyncio.get_running_loop().create_task(
                    self._read_events(), name=f"kvstore-redis-events-{self.prefix}"
                )
        self._subs.add(sub)
        if everything:
            self._everything.add(sub)
        for key in sub.keys:
            self._watchers.setdefault(key, set()).add(sub)
        return self._pos

    def _rewind(self, keep: _RedisSubscription, head: int) -> None:
        """The stream restarted below the reader (Redis lost its data): every other
        subscription may have missed events and ends (CapacityError); read from ``head``."""
        for sub in self._subs:
            if sub is not keep:
                sub.overflow()
        self._pos = head

    async def _head(self, timeout: float | None = None) -> int:
        """The number of the stream's newest entry (0 if none)."""
        return int(await self._call(lambda: self._redis.get(f"{self.prefix}:evn"), timeout) or 0)

    def _detach(self, sub: _RedisSubscription) -> None:
        self._subs.discard(sub)
        self._everything.discard(sub)
        for key in sub.keys:
            watchers = self._watchers.get(key)
            if watchers is not None:
                watchers.discard(sub)
                if not watchers:
                    del self._watchers[key]

    def _advance(self) -> None:
        """Wake every :meth:`_catch_up` waiter (the reader moved, failed or stopped)."""
        self._advanced.set()
        self._advanced = asyncio.Event()

    async def _read_events(self) -> None:
        """XREAD BLOCK from ``_pos`` while anyone subscribes; dispatch each entry. Redis
        errors are retried for ``timeout_s``, then fail every subscription."""
        loop = asyncio.get_running_loop()
        failing_since: float | None = None
        timeout = self._timeout_s + self._block_ms / 1000
        while self._subs and not self._closed:
            try:
                reply: Any = await self._call(self._xread, timeout)
            except Closed:
                break
            except (TransportError, KVTimeout) as exc:
                failing_since = loop.time() if failing_since is None else failing_since
                if loop.time() - failing_since >= self._timeout_s:
                    for sub in list(self._subs):
                        sub.fail(exc)
                    break
                await asyncio.sleep(min(0.1, self._timeout_s / 10))
                continue
            failing_since = None
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    self._dispatch(int(entry_id.split(b"-")[1]), fields[b"e"])
            self._advance()
        if self._reader is asyncio.current_task():
            self._reader = None
        self._advance()

    def _xread(self) -> Awaitable[Any]:
        streams: Any = {self._events_key: f"0-{self._pos}"}
        return self._redis.xread(streams, count=256, block=self._block_ms)

    def _dispatch(self, n: int, payload: bytes) -> None:
        """Hand entry ``n``'s events to every subscription that started before it."""
        if n <= self._pos:
            return
        if n != self._pos + 1:  # entries (pos, n) were trimmed before we read them
            for sub in self._subs:
                if sub.start is None or sub.start < n - 1:
                    sub.overflow()
        self._pos = n
        everything = self._everything
        for raw in json.loads(payload):
            if raw[0] == "node_dead":
                targets: Collection[_RedisSubscription] = self._subs
            else:
                watchers = self._watchers.get((raw[1], raw[2]))
                if not everything:
                    targets = watchers or ()
                else:
                    targets = watchers | everything if watchers else everything
            if targets:
                event = _event(raw)
                for sub in targets:
                    sub.push(n, event)

    async def _catch_up(self, sub: _RedisSubscription, deadline: float | None) -> None:
        """Wait (bounded) until the reader has dispatched every entry that existed when this
        was called, so a read sees every event committed before it."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self._timeout_s
        end = end if deadline is None else min(end, deadline)
        if end <= loop.time():
            return
        try:
            target = await self._head(end - loop.time())
        except KVTimeout:
            return
        while self._pos < target and self._reader is not None and not sub.done:
            remaining = end - loop.time()
            if remaining <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._advanced.wait(), remaining)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)

"""Every public method of ``KVClient`` and ``SyncKVClient``, driven with arbitrary arguments
(hypothesis) against a real ``kvstore serve``, either succeeds or raises a
``kvclient.errors.KVStoreError`` — never a ``TypeError``, ``AttributeError``,
``UnicodeEncodeError`` or anything else an engine would have to catch besides our tree —
and never hangs past its deadline. Arguments mix plausible values (token lists, tensors of
the namespace's shape, engine caches, block ids) with junk (wrong types, NaN, negative
sizes, surrogates in strings, tensors of other dtypes and shapes)."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import math
import os
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvclient
from kvclient.errors import KVStoreError
from kvstore.control.records import ClusterEventKind
from tests.cluster import Server, serving
from tests.test_kvctl import dead_port

pytestmark = pytest.mark.slow

H, D, BLOCK, LAYERS = 2, 16, 16, 2
NS = kvclient.Namespace(model="fuzz", revision="1", num_layers=LAYERS, num_kv_heads=H,
                        head_dim=D, dtype=torch.bfloat16, block_tokens=BLOCK,
                        quant="int8")  # fmt: skip
TIMEOUT_S = 1.0
"""The clients' default deadline: streams that wait for layers nobody writes end soon."""
CALL_BOUND_S = 20.0
"""A call still running after this long hangs: a failure."""
EXAMPLES = int(os.environ.get("KVSTORE_TEST_EXAMPLES", "50"))
"""Examples per method (a longer run: ``KVSTORE_TEST_EXAMPLES=600``: clean at 600 x 41 methods)."""

# ---- argument strategies -------------------------------------------------------------

_text = st.text(st.characters(codec=None, categories=None), max_size=12)
_junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), _text, st.binary(max_size=16),
    st.lists(st.integers(-5, 5), max_size=4), st.dictionaries(_text, st.integers(), max_size=2),
    st.just(object()), st.just([1, 2]), st.just(10**400), st.just(2**64),
    st.builds(lambda s: torch.zeros(s), st.lists(st.integers(0, 3), max_size=3)),
    st.builds(lambda n: torch.zeros(n, dtype=torch.int64), st.integers(0, 4)),
)  # fmt: skip
_tokens = st.lists(st.integers(0, 1000), min_size=0, max_size=5 * BLOCK)


def _kv(n: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(2, n, H, D).to(dtype)


_dtypes = st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.int8])
_tensor = st.builds(_kv, st.sampled_from([0, BLOCK, 2 * BLOCK, BLOCK + 3]), _dtypes)
_pair = _tensor.map(lambda t: (t[0], t[1]))
_cache = st.builds(
    lambda nb, layout: torch.zeros(
        (nb, 2, BLOCK, H, D) if layout else (2, nb, BLOCK, H, D), dtype=torch.bfloat16
    ),
    st.integers(0, 6),
    st.booleans(),
)
_id_tensor = st.builds(torch.tensor, st.lists(st.integers(0, 5), max_size=6))
_block_ids = st.one_of(st.lists(st.integers(-2, 8), max_size=6), _id_tensor)
_seconds = st.one_of(st.none(), st.sampled_from([0.0, -1.0, 0.05, 0.5, math.nan, math.inf]))
_key = st.one_of(_text, st.sampled_from(["k", "a/b", "\ud800", "x" * 5000]))
_value = st.one_of(st.binary(max_size=64), st.builds(bytearray, st.binary(max_size=8)),
                   st.builds(memoryview, st.binary(max_size=8)), st.just("a str"))  # fmt: skip
_instances = st.lists(
    st.builds(kvclient.Instance, st.text(max_size=4), st.integers(-5, 100), st.integers(-5, 100)),
    max_size=3,
)


def _either(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, _junk)  # plausible two times in three


ARGUMENTS: dict[str, st.SearchStrategy[Any]] = {
    "token_ids": _either(_tokens),
    "layer": _either(st.integers(-1, LAYERS)),
    "t": _either(st.one_of(_tensor, _pair)),
    "out": _either(st.one_of(st.none(), _tensor, _pair)),
    "device": st.one_of(st.none(), st.sampled_from(["cpu", "meta", "nonsense", 3])),
    "shard": _either(st.integers(-1, 2)),
    "timeout": _either(_seconds),
    "cache": _either(_cache),
    "caches": _either(st.lists(_cache, max_size=LAYERS + 1)),
    "block_ids": _either(_block_ids),
    "layout": _either(st.sampled_from(["blocks_first", "kv_first", "other"])),
    "skip_tokens": _either(st.integers(-BLOCK, 3 * BLOCK)),
    "hold_s": _either(st.sampled_from([0, 0.5, -1.0, math.nan, 1e9])),
    "tag": _either(st.one_of(st.none(), _key)),
    "key": _either(_key),
    "value": _either(_value),
    "instances": _either(_instances),
    "after_seq": _either(st.integers(-1, 10)),
    "log_id": _either(_text),
    "all_namespaces": _either(st.booleans()),
    "snapshot": _either(st.booleans()),
}
SKIP = {"close", "connect", "ns", "timeout_s"}
METHODS = sorted(
    name
    for name, _ in inspect.getmembers(kvclient.KVClient)
    if not name.startswith("_") and name not in SKIP
)


def _args_for(cls: type, name: str) -> st.SearchStrategy[dict[str, Any]]:
    params = inspect.signature(getattr(cls, name)).parameters
    wanted = {}
    for p in params.values():
        if p.name == "self" or p.kind is p.VAR_KEYWORD:
            continue
        strategy = ARGUMENTS[p.name]  # a new parameter needs a strategy here
        wanted[p.name] = strategy if p.default is p.empty else st.one_of(st.none(), strategy)
    return st.fixed_dictionaries(wanted)


def _drop_none_defaults(cls: type, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """None for an optional parameter means: leave it out (its default)."""
    params = inspect.signature(getattr(cls, name)).parameters
    return {
        k: v for k, v in kwargs.items() if v is not None or params[k].default is params[k].empty
    }


# ---- the clients -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with serving("64MiB") as srv:
        yield srv


class _Async:
    """A KVClient on an event loop of its own thread, so hypothesis' sync tests drive it."""

    def __init__(self, address: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.kv: kvclient.KVClient = self.run(
            kvclient.KVClient.connect(address, NS, timeout_s=TIMEOUT_S)
        )

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_BOUND_S + 5)

    def close(self) -> None:
        self.run(self.kv.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def async_client(server: Server) -> Iterator[_Async]:
    client = _Async(server.grpc)
    yield client
    client.close()


@pytest.fixture(scope="module")
def sync_client(server: Server) -> Iterator[kvclient.SyncKVClient]:
    kv = kvclient.SyncKVClient.connect(server.grpc, NS, timeout_s=TIMEOUT_S)
    yield kv
    kv.close()


async def _settle_async(result: Any) -> None:
    """Wait for what a call started: a handle, a stream (its first items)."""
    if isinstance(result, kvclient.Handle):
        await result
    elif isinstance(result, list) and result and isinstance(result[0], kvclient.Handle):
        for handle in result:
            await handle
    elif isinstance(result, AsyncIterator):
        try:
            async for _ in result:
                break
        finally:
            await result.aclose()  # type: ignore[attr-defined]


def _settle_sync(result: Any) -> None:
    if isinstance(result, kvclient.Handle):
        result.wait(CALL_BOUND_S)
    elif isinstance(result, list) and result and isinstance(result[0], kvclient.Handle):
        for handle in result:
            handle.wait(CALL_BOUND_S)
    elif isinstance(result, Iterator):
        list(itertools.islice(result, 1))


def _check(exc: BaseException | None, name: str, kwargs: dict[str, Any]) -> None:
    if exc is None or isinstance(exc, KVStoreError):
        return
    raise AssertionError(f"{name}(**{kwargs!r}) raised {type(exc).__name__}: {exc}") from exc


@pytest.mark.parametrize("name", METHODS)
def test_async_client_raises_only_kvstore_errors(async_client: _Async, name: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(_args_for(kvclient.KVClient, name))
    def check(kwargs: dict[str, Any]) -> None:
        kwargs = _drop_none_defaults(kvclient.KVClient, name, kwargs)

        async def call() -> BaseException | None:
            try:
                async with asyncio.timeout(CALL_BOUND_S):
                    result = getattr(async_client.kv, name)(**kwargs)
                    if inspect.isawaitable(result):
                        result = await result
                    await _settle_async(result)
            except TimeoutError as exc:
                if isinstance(exc, KVStoreError):
                    return exc
                raise AssertionError(f"{name}(**{kwargs!r}) hung past {CALL_BOUND_S} s") from exc
            except BaseException as exc:
                return exc
            return None

        _check(async_client.run(call()), name, kwargs)

    check()


@pytest.mark.parametrize("name", [m for m in METHODS if m != "events"])
def test_sync_client_raises_only_kvstore_errors(
    sync_client: kvclient.SyncKVClient, name: str
) -> None:
    @settings(max_examples=EXAMPLES, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(_args_for(kvclient.SyncKVClient, name))
    def check(kwargs: dict[str, Any]) -> None:
        kwargs = _drop_none_defaults(kvclient.SyncKVClient, name, kwargs)
        try:
            _settle_sync(getattr(sync_client, name)(**kwargs))
        except BaseException as exc:
            _check(exc, name, kwargs)

    check()


def test_the_three_reported_escapes_are_typed(sync_client: kvclient.SyncKVClient) -> None:
    """Found by trying the client: a surrogate in an object key (UnicodeEncodeError), a
    ``str`` value (TypeError), ``out=[1, 2]`` (AttributeError); each is InvalidArgument or
    BadShape now, raised before any I/O."""
    with pytest.raises(kvclient.errors.InvalidArgument, match="UTF-8"):
        sync_client.put_object("key\ud800", b"v")
    with pytest.raises(kvclient.errors.InvalidArgument, match="bytes-like"):
        sync_client.put_object("key", "a str")  # type: ignore[arg-type]
    with pytest.raises(kvclient.errors.BadShape):
        sync_client.get_layer(list(range(2 * BLOCK)), 0, out=[1, 2])
    with pytest.raises(kvclient.errors.InvalidArgument, match="not one contiguous buffer"):
        sync_client.put_object("key", memoryview(bytes(8))[::2])  # (it said "bytes-like")


def test_what_a_review_found_is_typed_or_accepted(
    sync_client: kvclient.SyncKVClient, server: Server
) -> None:
    """Values past float's range, protobuf's integer range, unknown route weights and
    tokens gRPC metadata cannot carry are refused as KVStoreError; a numpy buffer is a
    value ``put_object`` takes."""
    import numpy as np

    tokens = list(range(2 * BLOCK))
    with pytest.raises(kvclient.errors.InvalidArgument):
        sync_client.match_prefix(tokens, timeout=10**400)
    with pytest.raises(kvclient.errors.InvalidArgument, match="unknown weight"):
        sync_client.route(tokens, [kvclient.Instance("a")], bogus=1.0)
    with pytest.raises(kvclient.errors.InvalidArgument):
        sync_client.route(tokens, [kvclient.Instance("a", active_tokens=2**64)])
    with pytest.raises(kvclient.errors.InvalidArgument, match="printable ASCII"):
        kvclient.SyncKVClient.connect(server.grpc, NS, token="\u00e9" * 20)
    sync_client.put_object("np-value", np.arange(4, dtype=np.uint8))
    assert sync_client.get_object("np-value") == bytes(range(4))


async def test_a_closed_client_and_puts_it_cut_off_raise_closed(server: Server) -> None:
    """Found by trying the client: a put after ``close()`` raised AttributeError (from
    closing a future as if it were a coroutine), and a put in flight when ``close()`` came
    ended its caller with a bare CancelledError. Both are :class:`Closed` now, as the other
    calls on a closed client are."""
    tokens = list(range(4 * BLOCK))
    kv = await kvclient.KVClient.connect(server.grpc, NS, timeout_s=TIMEOUT_S)
    gate = asyncio.Event()
    sends = kv._send_chunks

    async def held(*args: Any) -> Any:  # (the put waits here until close() has begun)
        gate.set()
        await asyncio.sleep(TIMEOUT_S)
        return await sends(*args)

    kv._send_chunks = held  # type: ignore[method-assign]
    put = asyncio.ensure_future(kv.put_layer(tokens, 0, _kv(len(tokens))))
    await asyncio.wait_for(gate.wait(), TIMEOUT_S)
    await kv.close()
    with pytest.raises(kvclient.errors.Closed):
        await asyncio.wait_for(put, TIMEOUT_S)
    with pytest.raises(kvclient.errors.Closed):
        await kv.put_layer(tokens, 0, _kv(len(tokens)))
    with pytest.raises(kvclient.errors.Closed):
        await kv.start_put_layer(tokens, 0, _kv(len(tokens)))
    with pytest.raises(kvclient.errors.Closed):
        await kv.match_prefix(tokens)


@pytest.mark.parametrize(
    "options",
    [{"replicas": "2"}, {"replicas": 2.0}, {"replicas": True}, {"replicas": 0},
     {"replicas": 2, "min_replicas": 3}, {"min_replicas": 1.5}, {"timeout_s": "5"},
     {"node_timeout_s": -1}, {"connections_per_node": 0}, {"ucx": "yes"},
     {"staging_bytes": -1}, {"write_layers": [0, 1]}, {"max_object_bytes": 0}],
)  # fmt: skip
async def test_connect_options_of_the_wrong_kind_are_invalid_arguments(
    server: Server, options: dict[str, Any]
) -> None:
    """Found by trying the client: ``replicas="2"`` raised TypeError at connect and
    ``replicas=2.0`` at the first put; every option is checked where the client is made."""
    with pytest.raises(kvclient.errors.InvalidArgument):
        await kvclient.KVClient.connect(server.grpc, NS, **options)


def test_unknown_options_and_a_sync_timeout_of_the_wrong_kind_are_invalid_arguments() -> None:
    """Found by trying the client: an unknown option raised TypeError, and only after the
    master was dialled (here nothing listens: a dial would raise Unreachable), and the sync
    client's ``timeout_s="x"`` a ValueError."""
    with dead_port() as port:
        with pytest.raises(kvclient.errors.InvalidArgument, match="unknown options \\['bogus'\\]"):
            asyncio.run(kvclient.KVClient.connect(f"127.0.0.1:{port}", NS, bogus=1))
        with pytest.raises(kvclient.errors.InvalidArgument, match="timeout_s"):
            kvclient.SyncKVClient.connect(f"127.0.0.1:{port}", NS, timeout_s="x")


def test_the_sync_client_has_every_method_of_the_async_one(
    sync_client: kvclient.SyncKVClient,
) -> None:
    """``SyncKVClient`` has every public method of ``KVClient`` (it had no ``events``), and
    its event stream blocks for each batch: the log's id, then (a snapshot asked for) the
    index from CLEARED to SNAPSHOT_DONE."""
    public = {n for n in dir(kvclient.KVClient) if not n.startswith("_")}
    assert public <= set(dir(kvclient.SyncKVClient)), public - set(dir(kvclient.SyncKVClient))
    stream = sync_client.events(snapshot=True, timeout=30)
    try:
        log_id, first = next(stream)
        assert log_id and first == []
        got: list = []
        while not got or got[-1].kind is not ClusterEventKind.SNAPSHOT_DONE:
            got += next(stream)[1]
        assert got[0].kind is ClusterEventKind.CLEARED
    finally:
        stream.close()

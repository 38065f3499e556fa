"""``SyncKVClient``: every :class:`~kvclient.KVClient` method without ``await``.

Derived, not rewritten: each blocking method is generated from the async method of the
same name and runs it on one process-wide event-loop thread that all sync clients share
(:func:`~kvclient.handles.shared_loop`). Engine threads may call one client concurrently;
the calls interleave on the loop. ``start_*`` calls are the async client's own (they may be
called from any thread) and return handles at once.

    with SyncKVClient.connect("127.0.0.1:50051", ns) as kv:
        kv.put_layer(token_ids, layer, t)
        for layer, t in kv.stream_layers(token_ids, timeout=30): ...
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import Any, TypeVar

from kvstore.control.records import ClusterEvent
from kvstore.core.hashing import Namespace
from kvstore.errors import Miss

from . import args
from .client import KVClient
from .handles import LoopThread, prefix_len, shared_loop

__all__ = ["SyncKVClient"]

T = TypeVar("T")

_GRACE_S = 2.0
"""Slack on top of a call's own deadline before the loop thread is given up on."""

_BLOCKING = (
    "match_prefix",
    "release",
    "route",
    "get_layer",
    "get_layer_paged",
    "put_object",
    "get_object",
    "exists",
    "remove",
    "warm_up",
)
_DIRECT = (
    "block_hashes",
    "start_put_layer",
    "start_get_layer",
    "start_put_layer_paged",
    "start_get_layer_paged",
    "start_get_layers_paged",
    "start_stream_layers",
    "start_stream_layers_paged",
)


class SyncKVClient:
    """A blocking client; see the module docstring. Create with :meth:`connect`."""

    def __init__(self, client: KVClient, runner: LoopThread) -> None:
        self._client = client
        self._runner = runner

    @classmethod
    def connect(cls, master: str | Sequence[str], ns: Namespace, **options: Any) -> SyncKVClient:
        """Connect like :meth:`KVClient.connect` (same arguments), blocking."""
        runner = shared_loop()
        limit = args.seconds(options.get("timeout_s", 10.0), "timeout_s") + _GRACE_S
        client = runner.run(KVClient.connect(master, ns, **options), limit)
        return cls(client, runner)

    @property
    def ns(self) -> Namespace:
        """The client's namespace."""
        return self._client.ns

    @property
    def timeout_s(self) -> float:
        """Default deadline of every call."""
        return self._client.timeout_s

    def close(self) -> None:
        """Close the client (aborting puts in flight); idempotent. At interpreter exit, once
        the loop thread has stopped, there is nothing left to close: returns at once."""
        if not self._runner.alive:
            return
        self._runner.run(self._client.close(), self._client.timeout_s + _GRACE_S)

    def __enter__(self) -> SyncKVClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stream_layers(
        self,
        token_ids: Sequence[int] | Any,
        timeout: float | None = None,
        *,
        shard: int = 0,
        device: Any = None,
        out: Sequence[Any] | None = None,
    ) -> Iterator[tuple[int, Any]]:
        """Blocking twin of :meth:`KVClient.stream_layers` (same contract)."""
        limit = self._client._limit(timeout)
        agen = self._client.stream_layers(token_ids, limit, shard=shard, device=device, out=out)
        try:
            yield from self._blocking(agen, limit)
        except TimeoutError as exc:
            raise Miss("stream timed out", layer=None) from exc

    def events(
        self,
        after_seq: int = 0,
        log_id: str = "",
        *,
        all_namespaces: bool = False,
        snapshot: bool = False,
        timeout: float | None = None,
    ) -> Iterator[tuple[str, list[ClusterEvent]]]:
        """Blocking twin of :meth:`KVClient.events` (same contract): each ``(log_id,
        events)`` batch as it comes (a keep-alive at least every 10 s)."""
        limit = 3600.0 if timeout is None else args.seconds(timeout)
        agen = self._client.events(after_seq, log_id, all_namespaces=all_namespaces,
                                   snapshot=snapshot, timeout=limit)  # fmt: skip
        yield from self._blocking(agen, limit)

    def _blocking(self, agen: AsyncGenerator[T, None], limit: float) -> Iterator[T]:
        """The items of ``agen`` (run on the loop thread) as they come, each waited for up
        to what is left of ``limit`` seconds plus a grace (a stuck loop raises TimeoutError);
        ``agen`` is closed however this ends."""
        deadline = time.monotonic() + limit

        async def step() -> tuple[T] | None:
            try:
                return (await anext(agen),)
            except StopAsyncIteration:
                return None

        try:
            while True:
                left = max(0.0, deadline - time.monotonic()) + _GRACE_S
                item = self._runner.run(step(), left)
                if item is None:
                    return
                yield item[0]
        finally:
            self._runner.run(agen.aclose(), _GRACE_S)


def _put(name: str) -> Callable[..., Any]:
    """A blocking put whose encode starts on the calling thread, as a ``start_put`` does:
    on CUDA its kernels go onto the caller's current stream, after the kernels that wrote
    the KV (run on the loop thread they would go onto that thread's stream instead)."""
    method = getattr(KVClient, name)
    starts = {"put_layer": "_put_contiguous", "put_layer_paged": "_put_paged"}
    start = getattr(KVClient, starts[name])
    signature = inspect.signature(method)

    @functools.wraps(method)
    def call(self: SyncKVClient, *args: Any, **kwargs: Any) -> int:
        bound = signature.bind(self._client, *args, **kwargs)  # (TypeError as the method)
        bound.apply_defaults()
        given = dict(bound.arguments)
        timeout = given.pop("timeout")
        hashes, run = start(*given.values(), timeout=timeout, what=name)
        done = self._runner.run(run(), self._client._limit(timeout) + _GRACE_S)
        return prefix_len(done, len(hashes)) * self._client.ns.block_tokens

    call.__doc__ = f"Blocking twin of :meth:`KVClient.{name}`.\n\n{method.__doc__ or ''}"
    return call


def _blocking(name: str) -> Callable[..., Any]:
    method = getattr(KVClient, name)

    @functools.wraps(method)
    def call(self: SyncKVClient, *args: Any, **kwargs: Any) -> Any:
        limit = self._client._limit(kwargs.get("timeout")) + _GRACE_S
        return self._runner.run(method(self._client, *args, **kwargs), limit)

    call.__doc__ = f"Blocking twin of :meth:`KVClient.{name}`.\n\n{method.__doc__ or ''}"
    return call


def _direct(name: str) -> Callable[..., Any]:
    method = getattr(KVClient, name)

    @functools.wraps(method)
    def call(self: SyncKVClient, *args: Any, **kwargs: Any) -> Any:
        return method(self._client, *args, **kwargs)

    return call


for _name in _BLOCKING:
    setattr(SyncKVClient, _name, _blocking(_name))
for _name in ("put_layer", "put_layer_paged"):
    setattr(SyncKVClient, _name, _put(_name))
for _name in _DIRECT:
    setattr(SyncKVClient, _name, _direct(_name))

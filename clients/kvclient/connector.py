"""An engine connector in the shape of vLLM V1's ``KVConnectorBase_V1``, in our own types.

The connector is split by role, as engines split it: :class:`SchedulerConnector` lives in
the process that schedules requests and decides, per request, how many prompt tokens come
from the pool; :class:`WorkerConnector` lives in each process that runs the model and
moves the KV between the engine's paged cache and the pool, layer by layer, around the
forward pass. The scheduler hands the worker one :class:`ConnectorMetadata` per step.
Nothing here imports an engine; :mod:`kvclient.vllm_connector` adapts vLLM's objects to
these calls, and ``docs/engine-integration.md`` maps them method by method.

Per step, in the order an engine calls them::

    scheduler   get_num_new_matched_tokens(req, num_computed)   per waiting request
                update_state_after_alloc(req_id, block_ids, n)  after its blocks exist
                build_connector_meta(scheduled)                 once, end of schedule()
    worker      bind_connector_metadata(meta)
                start_load_kv()                                 before the forward pass
                  wait_for_layer_load(layer)                    before attention of layer
                  save_kv_layer(layer, cache)                   after attention of layer
                wait_for_save()                                 end of the forward pass
                get_finished(finished_ids) -> (sent, received)
                get_block_ids_with_load_errors()
                clear_connector_metadata()
    scheduler   request_finished(req_id, ...) -> (delay_free, params)   when a request ends

Loads are synchronous in the engine's sense (the request runs in the step that loads it)
but never block the forward pass as a whole: every layer's read starts in
``start_load_kv``, and ``wait_for_layer_load(l)`` waits only for layer ``l``, so layer
``l + 1`` lands while layer ``l`` computes. Saves are asynchronous: ``save_kv_layer``
starts the layer's put and returns; a finished request's blocks stay with the engine
(``delay_free``) until ``get_finished`` reports its saves done. A block that fails to
load is reported by engine block id and recomputed by the engine, never left as zeros.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.errors import InvalidArgument, KVStoreError

from .handles import Handle
from .lazy import NotConnected
from .paged import PagedCache

__all__ = [
    "ConnectorMetadata",
    "LoadSpec",
    "SaveSpec",
    "ScheduledRequest",
    "SchedulerConnector",
    "WorkerConnector",
]

logger = logging.getLogger("kvclient.connector")

DEFAULT_HOLD_S = 10.0
"""How long a match pins its slots for the load that follows: at most this, released
earlier when the request finishes (the scheduler does not see its workers' loads end)."""

_MAX_REQUESTS = 65536
"""Requests a connector tracks at once; past it, new requests are not cached."""


@dataclass(frozen=True)
class LoadSpec:
    """Load ``token_ids``'s whole blocks from ``skip_tokens`` on into ``block_ids``.

    ``skip_tokens`` is the engine's own prefix (never written); ``end_tokens`` the end of
    what the scheduler promised (a multiple of the engine's block size, at most the prompt
    minus one token); the last chunk read may run past it, into blocks the engine is about
    to compute anyway.
    """

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    skip_tokens: int
    end_tokens: int
    stream: bool = False
    """The blocks are still being written (a prefill instance computing the prompt now):
    every layer is read as it lands, from the master's watch."""


@dataclass(frozen=True)
class SaveSpec:
    """Save the whole blocks of ``token_ids`` (the tokens computed by the end of this
    step) from ``skip_tokens`` on (a multiple of ``block_tokens``: what earlier steps
    saved or the pool already held)."""

    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    skip_tokens: int


@dataclass(frozen=True)
class ConnectorMetadata:
    """What the scheduler tells the workers for one step (plain data, picklable)."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    aborted: tuple[str, ...] = ()
    """Requests that ended without finishing: their saves in flight are cancelled."""


@dataclass(frozen=True)
class ScheduledRequest:
    """A request scheduled in this step, as :meth:`SchedulerConnector.build_connector_meta`
    needs it: its prompt, its blocks in token order, the tokens computed before this step
    and the tokens this step computes."""

    request_id: str
    prompt_token_ids: Sequence[int]
    block_ids: Sequence[int]
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass
class _Tracked:
    prompt: tuple[int, ...]
    saved: int = 0  # tokens of the prompt saved (or known stored) so far
    local: int = 0  # the engine's own hit when it last asked
    stream: bool = False  # load as a prefill instance writes it
    saving: bool = False  # any save scheduled: the engine must keep its blocks


class SchedulerConnector:
    """The scheduler's half: how much of a prompt the pool holds, and what each step
    loads and saves.

    ``kv``: a client of the namespace the model's KV lives in. ``engine_block_size``: the
    engine's paged-cache block size (tokens); promised tokens are multiples of it.
    ``load``/``save``: whether this instance reads from and writes to the pool (a prefill
    instance of a disaggregated deployment saves, a decode instance loads; one instance
    may do both). ``hold_s``: how long a match pins its slots until the load.
    """

    def __init__(
        self,
        kv: Any,  # a SyncKVClient
        engine_block_size: int,
        *,
        load: bool = True,
        save: bool = True,
        hold_s: float = DEFAULT_HOLD_S,
    ) -> None:
        if engine_block_size < 1:
            raise ValueError(f"engine_block_size must be >= 1, got {engine_block_size}")
        self.kv = kv
        self.engine_block_size = engine_block_size
        self.load, self.save, self.hold_s = load, save, hold_s
        self._requests: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._aborted: list[str] = []
        self._lock = threading.Lock()

    def get_num_new_matched_tokens(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        num_computed_tokens: int,
        params: Mapping[str, Any] | None = None,
    ) -> tuple[int | None, bool]:
        """Prompt tokens past ``num_computed_tokens`` (the engine's own hit) that the pool
        can load now, and False (loads are synchronous). At most the prompt minus one
        token (the engine needs the last one's logits), a multiple of the engine's block
        size. A pool that cannot be asked answers 0: the engine computes. Idempotent: an
        engine may ask again for the same request.

        ``params`` ``{"kvstore": {"stream": True, "prompt_tokens": n}}`` (what a
        disaggregated deployment's router passes a decode instance while a prefill
        instance computes the same prompt): the first ``n`` tokens' whole blocks are
        promised without a match, and loaded layer by layer as the prefill saves them.
        """
        prompt = tuple(int(t) for t in prompt_token_ids)
        with self._lock:
            if request_id not in self._requests and len(self._requests) >= _MAX_REQUESTS:
                return 0, False
            tracked = self._requests.setdefault(request_id, _Tracked(prompt))
        if not self.load:
            return 0, False
        bs, B = self.engine_block_size, self.kv.ns.block_tokens
        ours = (params or {}).get("kvstore")
        if isinstance(ours, Mapping) and ours.get("stream") and num_computed_tokens == 0:
            promised = min(int(ours.get("prompt_tokens", len(prompt))), len(prompt))
            tracked.stream, tracked.local = True, 0
            return min(promised // B * B, (len(prompt) - 1) // bs * bs), False
        try:
            hit = self.kv.match_prefix(prompt, hold_s=self.hold_s, tag=request_id)
        except NotConnected:  # warned once when the engine started: compute it
            return 0, False
        except KVStoreError as exc:
            logger.warning("match_prefix for %s failed, computing it: %s", request_id, exc)
            return 0, False
        usable = min(hit, (len(prompt) - 1) // bs * bs)
        tracked.saved = max(tracked.saved, hit)  # stored already: nothing to save there
        tracked.local = num_computed_tokens
        return max(0, usable - num_computed_tokens), False

    def update_state_after_alloc(
        self, request_id: str, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """The engine allocated ``block_ids`` (all of the request's blocks, in token
        order) and takes ``num_external_tokens`` from the pool: queue their load for the
        next :meth:`build_connector_meta`."""
        tracked = self._requests.get(request_id)
        if tracked is None or num_external_tokens <= 0:
            return
        local = tracked.local  # the engine's own hit; the external tokens follow it
        blocks = tuple(int(b) for b in block_ids)
        end = local + num_external_tokens
        spec = LoadSpec(request_id, tracked.prompt, blocks, local, end, tracked.stream)
        self._loads.append(spec)

    def prompt_of(self, request_id: str) -> tuple[int, ...] | None:
        """The prompt of a request this connector tracks (None for others)."""
        tracked = self._requests.get(request_id)
        return None if tracked is None else tracked.prompt

    def build_connector_meta(self, scheduled: Iterable[ScheduledRequest]) -> ConnectorMetadata:
        """This step's loads (queued by :meth:`update_state_after_alloc`) and saves (the
        whole blocks each scheduled prompt completes in this step and no earlier step or
        the pool holds); resets the step's state."""
        B = self.kv.ns.block_tokens
        saves: list[SaveSpec] = []
        for req in scheduled:
            tracked = self._requests.get(req.request_id)
            if tracked is None or not self.save:
                continue
            done = min(req.num_computed_tokens + req.num_scheduled_tokens, len(tracked.prompt))
            end = done // B * B
            if end <= tracked.saved:
                continue
            blocks = tuple(int(b) for b in req.block_ids)
            saves.append(SaveSpec(req.request_id, tracked.prompt[:end], blocks, tracked.saved))
            tracked.saved, tracked.saving = end, True
        meta = ConnectorMetadata(tuple(self._loads), tuple(saves), tuple(self._aborted))
        self._loads, self._aborted = [], []
        return meta

    def request_finished(
        self,
        request_id: str,
        *,
        aborted: bool = False,
        output_token_ids: Sequence[int] | None = None,
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request ended (or was ``aborted``): whether the engine must keep its blocks
        until the workers report its saves done (``get_finished``), and the parameters a
        disaggregated deployment hands to the decode instance (the router passes them on,
        as vLLM's ``kv_transfer_params``): ``{"kvstore": {"prompt_tokens", "saved_tokens",
        "first_token"}}``, the first token being the prefill's first output token when
        ``output_token_ids`` is given (a router can stream it to the user before the decode
        instance has run; a decode told ``"stream": True`` loads what was saved). Releases
        the request's holds."""
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return False, None
        if self.load:  # only a loading instance holds
            try:
                self.kv.release(request_id)
            except KVStoreError as exc:  # holds expire by themselves
                logger.warning("release for %s failed: %s", request_id, exc)
        if aborted:
            self._aborted.append(request_id)
            return tracked.saving, None
        ours: dict[str, Any] = {"prompt_tokens": len(tracked.prompt), "saved_tokens": tracked.saved}
        if output_token_ids:
            ours["first_token"] = int(output_token_ids[0])
        return tracked.saving, {"kvstore": ours}


@dataclass
class _Saves:
    handles: list[Handle] = field(default_factory=list)
    finished: bool = False  # the engine said the request ended


class WorkerConnector:
    """The worker's half: loads and saves between the engine's paged cache and the pool.

    ``kv``: this worker's client (created after the engine forked it). ``shard``: its TP
    rank. ``timeout_s``: each load's and save's deadline.
    """

    def __init__(
        self, kv: Any, *, shard: int = 0, timeout_s: float = 10.0, stream_timeout_s: float = 60.0
    ) -> None:
        self.kv, self.shard, self.timeout_s = kv, shard, timeout_s
        self.stream_timeout_s = stream_timeout_s
        self._streams: list[tuple[LoadSpec, Any]] = []  # (spec, StreamHandle) of this step
        self._failed_streams: set[str] = set()
        self._caches: list[PagedCache] = []
        self._layout = "kv_first"
        self._layer_of: dict[str, int] = {}
        self._meta: ConnectorMetadata | None = None
        self._loads: dict[int, list[tuple[LoadSpec, Handle]]] = {}
        self._saves: dict[str, _Saves] = {}
        self._load_errors: set[int] = set()
        self._engine_bs = 0

    # ---------------------------------------------------------------- registration

    def register_kv_caches(
        self,
        caches: Mapping[str, Any],
        layout: str | None = None,
    ) -> None:
        """The engine's paged caches, layer name → cache, in model order (layer ``i`` of
        the namespace is the ``i``-th entry). ``layout`` ``"kv_first"``
        ``[2, num_blocks, block_size, H, D]``, ``"blocks_first"``
        ``[num_blocks, 2, block_size, H, D]`` (guessed from the shape when None) or
        ``"kv_pair"``: each cache a ``(K, V)`` pair of ``[num_blocks, block_size, H, D]``
        views (:mod:`kvclient.layouts` makes them from an engine's page form). Block ids
        in the specs index these caches. Then warms the client up for transfers of
        these caches (:meth:`~kvclient.KVClient.warm_up`; a
        :class:`~kvclient.lazy.PoolLink` does it in the background, except on CUDA), so
        the first request does not pay for it: a plain client blocks here for it (~0.5-1 s
        when a node takes ``ucx://``).
        Raises :class:`~kvstore.errors.BadShape` or
        :class:`~kvstore.errors.InvalidArgument` for caches that do not fit."""
        names = list(caches)
        L = self.kv.ns.num_layers
        if len(names) != L:
            raise ValueError(f"{len(names)} KV caches for a namespace of {L} layers")
        first = caches[names[0]]
        if layout is None:
            layout = "kv_first" if first.shape[0] == 2 else "blocks_first"
        ns = self.kv.ns
        paged = [
            PagedCache(caches[n], layout).expect(ns.num_kv_heads, ns.head_dim, ns.dtype)
            for n in names
        ]
        self._layout = layout
        self._caches = paged
        self._layer_of = {n: i for i, n in enumerate(names)}
        self._engine_bs = paged[0].block_size
        try:  # (a PoolLink never raises; a client, as its first transfer would)
            self.kv.warm_up(paged[0].device)
        except (KVStoreError, OSError) as exc:  # (the first transfers pay for it instead)
            logger.warning("kvstore warm-up failed: %s", exc)

    def layer_index(self, layer: str | int) -> int:
        """A layer name (or index) → its index."""
        return layer if isinstance(layer, int) else self._layer_of[layer]

    # ---------------------------------------------------------------- per step

    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        self._meta = meta
        for request_id in meta.aborted:
            saves = self._saves.get(request_id)
            if saves is not None:
                for h in saves.handles:
                    h.cancel()
                saves.finished = True

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self) -> None:
        """Start every layer's read for this step's loads (returns at once)."""
        meta = self._meta
        if meta is None or not meta.loads:
            return
        B = self.kv.ns.block_tokens
        for spec in meta.loads:
            n = -(-spec.end_tokens // B) * B  # the chunks holding the promised tokens
            try:
                if spec.stream:  # one watch for every layer, read as the prefill saves it
                    handle = self.kv.start_stream_layers_paged(
                        spec.token_ids[:n], self._caches, spec.block_ids, self._layout,
                        self.stream_timeout_s, shard=self.shard,
                    )  # fmt: skip
                    self._streams.append((spec, handle))
                    continue
                handles = self.kv.start_get_layers_paged(  # one Lookup for every layer
                    spec.token_ids[:n], self._caches, spec.block_ids, self._layout,
                    self.shard, timeout=self.timeout_s, skip_tokens=spec.skip_tokens,
                )  # fmt: skip
            except InvalidArgument:  # a call that does not fit the cache: a bug, not the pool
                raise
            except KVStoreError as exc:  # the pool went away since the match: recompute
                logger.warning("load of %s not started: %s", spec.request_id, exc)
                self._load_errors |= self._engine_blocks(spec, 0, spec.end_tokens)
                continue
            for layer, handle in enumerate(handles):
                self._loads.setdefault(layer, []).append((spec, handle))

    def wait_for_layer_load(self, layer: str | int) -> None:
        """Wait for ``layer``'s reads of this step; blocks that did not load (or a read
        that failed) are recorded for :meth:`get_block_ids_with_load_errors`."""
        index = self.layer_index(layer)
        B = self.kv.ns.block_tokens
        for spec, stream in self._streams:
            self._wait_stream(spec, stream, index)
        for spec, handle in self._loads.pop(index, []):
            try:
                missing = [b for b, _ in handle.wait(timeout=self.timeout_s + 1).missing]
            except KVStoreError as exc:
                handle.cancel()  # never let a late read write blocks the engine recomputes
                logger.warning("load of %s failed: %s", spec.request_id, exc)
                missing = list(range(spec.skip_tokens // B, -(-spec.end_tokens // B)))
            for chunk in missing:
                self._load_errors |= self._engine_blocks(spec, chunk * B, (chunk + 1) * B)

    def _engine_blocks(self, spec: LoadSpec, lo: int, hi: int) -> set[int]:
        """Engine block ids holding the promised tokens ``[lo, hi)`` of ``spec``."""
        lo, hi = max(lo, spec.skip_tokens), min(hi, spec.end_tokens)
        bs = self._engine_bs
        return {spec.block_ids[t // bs] for t in range(lo, hi, bs)} if hi > lo else set()

    def save_kv_layer(self, layer: str | int, cache: torch.Tensor | None = None) -> None:
        """Start saving ``layer`` for this step's saves (returns at once): the blocks stay
        the engine's until :meth:`get_finished` reports the request."""
        meta = self._meta
        if meta is None or not meta.saves:
            return
        index = self.layer_index(layer)
        paged = self._caches[index] if cache is None else PagedCache(cache, self._layout)
        for spec in meta.saves:
            saves = self._saves.setdefault(spec.request_id, _Saves())  # reported either way
            try:
                handle = self.kv.start_put_layer_paged(
                    spec.token_ids, index, paged, spec.block_ids, self._layout,
                    self.shard, timeout=self.timeout_s, skip_tokens=spec.skip_tokens,
                )  # fmt: skip
            except NotConnected:
                continue  # not stored: a cache, the next request computes it
            except InvalidArgument:
                raise
            except KVStoreError as exc:
                logger.info("save of %s layer %d not started: %s", spec.request_id, index, exc)
                continue
            saves.handles.append(handle)

    def wait_for_save(self) -> None:
        """Saves are asynchronous: nothing to wait for here (see :meth:`get_finished`).
        Reads of layers the model never waited for are waited for now, so no read of
        this step outlives it."""
        for layer in list(self._loads):
            self.wait_for_layer_load(layer)
        for spec, stream in self._streams:
            self._wait_stream(spec, stream, None)
        self._streams, self._failed_streams = [], set()

    def _wait_stream(self, spec: LoadSpec, stream: Any, layer: int | None) -> None:
        """Wait for ``layer`` of a streamed load (every layer when None); a stream that
        fails or times out is cancelled and all its blocks are recorded as not loaded."""
        if spec.request_id in self._failed_streams:
            return
        try:
            if layer is None:
                stream.wait(timeout=self.stream_timeout_s + 1)
            else:
                stream.layer(layer, timeout=self.stream_timeout_s + 1)
        except KVStoreError as exc:
            stream.cancel()
            self._failed_streams.add(spec.request_id)
            logger.warning("stream of %s failed at layer %s: %s", spec.request_id, layer, exc)
            self._load_errors |= self._engine_blocks(spec, 0, spec.end_tokens)

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """(requests with saves whose saves all ended, since the engine said they finished:
        the engine frees their blocks now; requests whose asynchronous loads ended: none,
        loads are synchronous). A finished request that saved nothing is never reported
        (the engine freed its blocks at once)."""
        for request_id in finished_req_ids:  # only requests the engine keeps blocks for
            if request_id in self._saves:
                self._saves[request_id].finished = True
        done = {
            r for r, s in self._saves.items() if s.finished and all(h.done() for h in s.handles)
        }
        for request_id in done:
            for h in self._saves.pop(request_id).handles:
                try:
                    h.wait(timeout=0)
                except KVStoreError as exc:  # a cache: the next request recomputes
                    logger.info("save of %s not stored: %s", request_id, exc)
        return done, set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine block ids whose load failed since the last call (the engine recomputes
        them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for saves in self._saves.values():
            for h in saves.handles:
                h.cancel()
        self._saves.clear()

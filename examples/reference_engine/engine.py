"""A reference inference engine on the kvstore connector: a scheduler half and a worker half
stepped the way vLLM V1 steps its connector, over :mod:`examples.reference_engine.model`.

One request at a time, greedy decoding. A request's life:

1. **schedule**: ``get_num_new_matched_tokens`` (how much of the prompt the pool holds),
   allocate engine blocks (a shuffled free list, so the block table matters), then
   ``update_state_after_alloc``;
2. **prefill step**: ``build_connector_meta``; the worker binds it and starts every
   layer's load; the forward pass computes the prompt's remaining tokens, waiting for each
   layer's load just before that layer's attention and saving each layer after it; then
   ``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``;
3. **recompute**: blocks that failed to load send the request back to the first of them,
   as vLLM does: that step's output is dropped and the prompt is computed again from there;
4. **decode steps**, one token each; then ``request_finished`` and, while its saves are in
   flight, empty steps until ``get_finished`` reports it (its blocks are then freed).
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from kvclient.connector import ScheduledRequest, SchedulerConnector, WorkerConnector

from .model import PagedKV, build_model

__all__ = ["Engine", "Output", "reference_generate"]


@dataclass
class Output:
    """What one request produced, and what the pool did for it."""

    tokens: list[int]
    """Greedy tokens after the prompt (the first one from the prompt's last position)."""
    logits: list[torch.Tensor] = field(repr=False)
    """The logits each token was chosen from."""
    loaded_tokens: int = 0
    """Prompt tokens the pool supplied (0 on a miss)."""
    recomputed_from: int | None = None
    """Where a failed load sent the prompt back to, if one did."""
    load_errors: set[int] = field(default_factory=set)
    params: dict[str, Any] | None = None
    """What ``request_finished`` hands a decode instance."""
    timings: dict[str, Any] = field(default_factory=dict)
    """``time.monotonic()`` marks of the first (prefill) step: ``forward_start``,
    ``forward_end``, ``layer_ready`` (when each layer's load was in, before its
    attention), ``first_token``; and ``saved`` (when the request's saves were reported
    done)."""


class Engine:
    """A model, its paged KV cache and the two halves of the connector.

    ``kv``: a ``SyncKVClient`` of the model's namespace, or None for no pool. ``load`` and
    ``save``: the instance's role (a prefill instance saves, a decode instance loads).
    """

    def __init__(
        self,
        model: Any,
        kv: Any = None,
        *,
        load: bool = True,
        save: bool = True,
        block_size: int = 4,
        num_blocks: int = 512,
        seed: int = 0,
        stream_s: float = 60.0,
    ) -> None:
        cfg = model.config
        self.model, self.kv, self.block_size = model, kv, block_size
        H, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
        shape = (2, num_blocks, block_size, H, D)
        self.pages = [torch.zeros(shape) for _ in range(cfg.num_hidden_layers)]
        self._free = list(range(num_blocks))
        random.Random(seed).shuffle(self._free)
        self.scheduler: SchedulerConnector | None = None
        self.worker: WorkerConnector | None = None
        if kv is not None:
            self.scheduler = SchedulerConnector(kv, block_size, load=load, save=save)
            self.worker = WorkerConnector(kv, timeout_s=kv.timeout_s, stream_timeout_s=stream_s)
            names = {f"model.layers.{i}.self_attn": p for i, p in enumerate(self.pages)}
            # (it also warms the client up, blocking here: ~0.5-1 s where a node takes
            # ucx://, so that the first request does not pay for UCX's start)
            self.worker.register_kv_caches(names, layout="kv_first")

    # ---------------------------------------------------------------- a request

    def schedule(
        self, prompt: list[int], max_new: int, params: dict[str, Any] | None = None
    ) -> _Request:
        """Ask the pool, allocate the request's blocks and queue its load. ``params``: what
        a router hands a decode instance (``{"kvstore": {"stream": True, "prompt_tokens":
        n}}`` while a prefill instance computes the prompt: load it as it lands)."""
        rid = uuid.uuid4().hex
        need = -(-(len(prompt) + max_new) // self.block_size)
        if need > len(self._free):
            raise RuntimeError(f"a request of {need} blocks does not fit the cache")
        blocks = [self._free.pop() for _ in range(need)]
        external = 0
        if self.scheduler is not None:
            got, _ = self.scheduler.get_num_new_matched_tokens(rid, prompt, 0, params)
            external = got or 0
            self.scheduler.update_state_after_alloc(rid, blocks, external)
        return _Request(rid, list(prompt), blocks, external, max_new)

    def run(self, req: _Request) -> Output:
        """Prefill (with recompute after failed loads), decode, finish; the output."""
        out = Output([], [], loaded_tokens=req.computed)
        logits = self._step(req, req.prompt[req.computed :], out, out.timings)
        if out.load_errors:  # vLLM's recompute path: back to the first block that failed
            bad = min(req.blocks.index(b) for b in out.load_errors) * self.block_size
            out.recomputed_from = req.computed = min(bad, req.computed)
            out.loaded_tokens = req.computed
            logits = self._step(req, req.prompt[req.computed :], out, out.timings)
        out.timings["first_token"] = time.monotonic()
        for _ in range(req.max_new):
            token = int(logits.argmax())
            out.tokens.append(token)
            out.logits.append(logits)
            if len(out.tokens) == req.max_new:
                break
            logits = self._step(req, [token], out)
        self._finish(req, out)
        return out

    def generate(
        self, prompt: list[int], max_new: int, params: dict[str, Any] | None = None
    ) -> Output:
        """:meth:`schedule` then :meth:`run`."""
        return self.run(self.schedule(prompt, max_new, params))

    # ---------------------------------------------------------------- one step

    def _step(
        self, req: _Request, tokens: list[int], out: Output, marks: dict[str, Any] | None = None
    ) -> torch.Tensor:
        """One engine step computing ``tokens`` at positions ``req.computed ..``; the
        logits of the last one. ``marks``: where to record the step's times."""
        worker = self.worker
        if worker is not None and self.scheduler is not None:
            sched = ScheduledRequest(req.rid, req.prompt, req.blocks, req.computed, len(tokens))
            worker.bind_connector_metadata(self.scheduler.build_connector_meta([sched]))
            worker.start_load_kv()
        ready: list[float] = []

        def before_layer(layer: int) -> None:
            if worker is not None:
                worker.wait_for_layer_load(layer)
            ready.append(time.monotonic())

        cache = PagedKV(
            self.pages,
            req.blocks,
            before_layer=before_layer,
            after_layer=worker.save_kv_layer if worker else None,
        )
        start = time.monotonic()
        cache.begin(req.computed)
        ids = torch.tensor([tokens])
        pos = torch.arange(req.computed, req.computed + len(tokens)).unsqueeze(0)
        with torch.no_grad():
            result = self.model(
                ids, cache=cache, position_ids=pos, use_cache=True, logits_to_keep=1
            )
        req.computed += len(tokens)
        if marks is not None:
            marks.update(forward_start=start, forward_end=time.monotonic(), layer_ready=ready)
        if worker is not None:
            worker.wait_for_save()
            worker.get_finished(set())
            out.load_errors |= worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
        return result.logits[0, -1].float()

    def _finish(self, req: _Request, out: Output) -> None:
        """``request_finished``; empty steps until the saves are reported; free blocks."""
        if self.scheduler is not None and self.worker is not None:
            delay, out.params = self.scheduler.request_finished(
                req.rid, output_token_ids=out.tokens
            )
            finished = {req.rid}
            deadline = time.monotonic() + self.worker.timeout_s + 5  # each save has its own
            while delay and time.monotonic() < deadline:
                self.worker.bind_connector_metadata(self.scheduler.build_connector_meta([]))
                sent, _ = self.worker.get_finished(finished)
                self.worker.clear_connector_metadata()
                finished = set()
                if req.rid in sent:
                    out.timings["saved"] = time.monotonic()
                    break
                time.sleep(0.001)
        self._free.extend(req.blocks)


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    blocks: list[int]
    computed: int
    max_new: int


def reference_generate(kind: str, prompt: list[int], max_new: int, seed: int = 0) -> Output:
    """The same model in one process with transformers' own cache: the tokens to match."""
    from transformers.cache_utils import DynamicCache

    model = build_model(kind, seed)
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    out = Output([], [])
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            token = int(logits.argmax())
            out.tokens.append(token)
            out.logits.append(logits.float())
            ids = torch.tensor([[token]])
    return out

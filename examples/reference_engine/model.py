"""A real model implementation (Hugging Face transformers' Llama or Qwen2) on a paged KV cache
whose every layer passes through the kvstore connector.

transformers calls ``cache.update(k, v, layer_idx)`` inside each attention layer, after the
layer's K and V exist and before attention reads them. :class:`PagedKV` is that cache: it
keeps K and V in pages ``[2, num_blocks, block_size, H, D]`` (the connector's ``kv_first``
layout) addressed through the request's block table, and around each layer it calls the
worker connector the way an engine's attention layer does — ``wait_for_layer_load`` before
the layer's K and V are read (a prefix loaded from the pool lands layer by layer while
earlier layers compute) and ``save_kv_layer`` after the new tokens are written.

The causal mask is built once per forward, before layer 0 runs, from the length the cache
reports; so the prefix length is announced (:meth:`PagedKV.begin`) before any of its
layers has landed. Batch 1, one request at a time: a reference, not a serving engine.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["MODELS", "SMALL_CONFIG", "PagedKV", "build_model", "load_checkpoint"]

MODELS = ("llama", "qwen2")

SMALL_CONFIG = {  # a small model: random weights from a fixed seed, nothing downloaded
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}


def load_checkpoint(path: str) -> Any:
    """A local Hugging Face checkpoint directory's causal LM (float32, eval mode, SDPA
    attention); nothing is downloaded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    return model.eval()


def build_model(kind: str = "llama", seed: int = 0, **sizes: int) -> Any:
    """``kind``'s causal LM with random weights from ``seed`` (float32, eval mode).
    ``sizes`` override the small default config (``num_hidden_layers``, ``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ...). ``kind`` may also be a local
    checkpoint directory (:func:`load_checkpoint`; ``seed`` and ``sizes`` then unused)."""
    if os.path.isdir(kind):
        return load_checkpoint(kind)
    if kind not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {kind!r}")
    torch.manual_seed(seed)
    fields = {**SMALL_CONFIG, **sizes}
    config = LlamaConfig(**fields) if kind == "llama" else Qwen2Config(**fields)
    config._attn_implementation = "sdpa"
    cls = LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM
    return cls(config).to(torch.float32).eval()


class _Layer(CacheLayerMixin):
    """One layer's view of the paged cache: a token count (metadata, so a prefix can be
    announced before it lands) over the shared pages and block table."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: PagedKV, index: int) -> None:
        super().__init__()
        self.owner, self.index, self.num_tokens = owner, index, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, q = self.num_tokens, key_states.shape[-2]
        pages = self.owner.pages[self.index]
        slots = self.owner.slots(start, start + q)
        H, D = pages.shape[-2], pages.shape[-1]
        # [1, H, q, D] -> [q, H, D]: a view of the projection's token-major buffer.
        pages[0].view(-1, H, D)[slots] = key_states[0].transpose(0, 1)
        pages[1].view(-1, H, D)[slots] = value_states[0].transpose(0, 1)
        self.num_tokens = start + q
        every = self.owner.slots(0, self.num_tokens)
        k = pages[0].view(-1, H, D).index_select(0, every).transpose(0, 1).unsqueeze(0)
        v = pages[1].view(-1, H, D).index_select(0, every).transpose(0, 1).unsqueeze(0)
        return k, v

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.num_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1


class PagedKV(Cache):
    """The engine's paged KV cache for one request, hooked per layer.

    ``pages[l]`` is layer ``l``'s ``[2, num_blocks, block_size, H, D]`` tensor (shared by
    every request the engine runs); ``block_table`` the request's blocks in token order.
    ``before_layer(l)`` runs before layer ``l`` reads its K and V (the connector's
    ``wait_for_layer_load``), ``after_layer(l)`` after the layer's new tokens are in the
    pages (``save_kv_layer``).
    """

    def __init__(
        self,
        pages: list[torch.Tensor],
        block_table: list[int],
        before_layer: Callable[[int], None] | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> None:
        self.pages, self.block_size = pages, int(pages[0].shape[2])
        self._table = torch.tensor(block_table, dtype=torch.int64)
        self.before_layer, self.after_layer = before_layer, after_layer
        self._mine = [_Layer(self, i) for i in range(len(pages))]
        super().__init__(layers=list(self._mine))

    def slots(self, lo: int, hi: int) -> torch.Tensor:
        """Flat page slots of tokens ``lo .. hi - 1``."""
        pos = torch.arange(lo, hi)
        return self._table[pos // self.block_size] * self.block_size + pos % self.block_size

    def begin(self, computed: int) -> None:
        """The tokens ``0 .. computed - 1`` are (or are about to be, layer by layer) in the
        pages: the next forward starts at position ``computed``."""
        for layer in self._mine:
            layer.num_tokens = computed

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.before_layer is not None:
            self.before_layer(layer_idx)
        out = self._mine[layer_idx].update(key_states, value_states, *args, **kwargs)
        if self.after_layer is not None:
            self.after_layer(layer_idx)
        return out

"""A reference disaggregated engine on a real model implementation (Hugging Face
transformers' Llama or Qwen2, random weights from a fixed seed), wired to kvstore through
:mod:`kvclient.connector`. Needs the ``engine`` extra (``pip install -e '.[engine]'``).

``python -m examples.reference_engine prefill|decode|reference --master HOST:PORT ...``
runs one side as its own process and prints one JSON line per prompt; see ``__main__.py``.
"""

from __future__ import annotations

__all__ = ["Engine", "Output", "build_model", "namespace", "reference_generate"]

import os

from transformers import AutoConfig

import kvclient

from .engine import Engine, Output, reference_generate
from .model import build_model


def namespace(
    kind: str, quant: str, seed: int = 0, block_tokens: int = 16, **sizes: int
) -> kvclient.Namespace:
    """The pool namespace of :func:`build_model` ``(kind, seed, **sizes)``'s KV. For a
    checkpoint directory, the namespace vLLM's connector derives for the same directory
    (model = the path as given, revision ``main``, float32): a pool shared with vLLM."""
    if os.path.isdir(kind):
        cfg = AutoConfig.from_pretrained(kind, local_files_only=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return kvclient.Namespace(
            model=kind, revision="main", num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim, dtype="float32",
            block_tokens=block_tokens, quant=quant,
        )  # fmt: skip
    cfg = build_model(kind, seed, **sizes).config
    shape = "-".join(f"{k}{v}" for k, v in sorted(sizes.items()))
    return kvclient.Namespace(
        model=f"reference-{kind}{'-' + shape if shape else ''}", revision=f"seed{seed}",
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.hidden_size // cfg.num_attention_heads,
        dtype="float32", block_tokens=block_tokens, quant=quant,
    )  # fmt: skip

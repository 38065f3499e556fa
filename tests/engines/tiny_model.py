"""Write a tiny random-weight Llama checkpoint directory (config.json + safetensors), no hub.

``initializer_range=0.1``: with transformers' default 0.02 a random model's logits are so
flat that every greedy token is the same, and a token comparison proves nothing. Runs in
the test suite's environment (``.venv``); vLLM reads the directory it writes.
"""

from __future__ import annotations

from pathlib import Path

from examples.reference_engine.model import SMALL_CONFIG

CONFIG = {**SMALL_CONFIG, "initializer_range": 0.1, "tie_word_embeddings": False}
"""The reference engine's small Llama, with logits spread enough to vary greedy tokens."""


def write_checkpoint(path: str | Path, seed: int = 0, **overrides: int) -> Path:
    """A Llama checkpoint with random weights from ``seed`` at ``path`` (float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    torch.manual_seed(seed)
    config = LlamaConfig(**{**CONFIG, **overrides})
    config.dtype = torch.float32
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    return out

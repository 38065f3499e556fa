"""Write a tiny random-weight Llama checkpoint directory (config.json + safetensors), no hub.

``initializer_range=0.1``: with transformers' default 0.02 a random model's logits are so
flat that every greedy token is the same, and a token comparison proves nothing. Runs in
either environment (both have transformers): ``python tests/engines/tiny_model.py DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

CONFIG = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}


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


if __name__ == "__main__":
    print(write_checkpoint(sys.argv[1]))

"""kvstore: a KV-cache pool for disaggregated LLM inference (server side and shared core)."""

__version__ = "0.1.0"

"""Real engines driven by the tests: a tiny checkpoint they share and vLLM's CPU build in an
environment of its own (``.venv-vllm``), each run in an OS process of its own."""

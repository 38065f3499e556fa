"""One real vLLM instance (its CPU build) answering requests from stdin, one JSON per line.

Runs under ``.venv-vllm`` (vLLM is never a dependency of kvstore), started by
``tests/test_vllm.py`` as ``python tests/engines/vllm_serve.py CONFIG_JSON``. CONFIG_JSON:
``model`` (a checkpoint directory), ``block_size``, ``dtype`` and, to use the pool, ``kv``:
vLLM's ``kv_transfer_config`` (without it the instance is a plain vLLM). Once the engine is
up it prints ``{"ready": true}``; then each stdin line ``{"id", "prompt", "max_tokens",
"params"?}`` is answered by one stdout line ``{"id", "tokens", "logprobs",
"num_cached_tokens", "kv_transfer_params"}`` (greedy; ``logprobs`` the chosen tokens'),
``{"id", "error"}`` when generation raised. A line with ``"abort_after_steps": n`` adds the
request, steps the engine ``n`` times and aborts it (answered ``{"id", "aborted"}``).
Stdin closed ends the process. Everything else
vLLM prints goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # ~13 s a start, not 30-45 s
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _answer(out: Any, rid: str) -> dict[str, Any]:
    completion = out.outputs[0]
    logprobs = [
        float(step[token].logprob)
        for step, token in zip(completion.logprobs or [], completion.token_ids, strict=False)
    ]
    return {
        "id": rid,
        "tokens": list(completion.token_ids),
        "logprobs": logprobs,
        "num_cached_tokens": int(out.num_cached_tokens or 0),
        "kv_transfer_params": getattr(out, "kv_transfer_params", None),
    }


def _abort(llm: Any, rid: str, job: dict[str, Any], params: Any) -> dict[str, Any]:
    """Add the request, run ``abort_after_steps`` engine steps, abort it (what a client
    that hangs up does), and step until the engine has nothing left (bounded)."""
    engine = llm.llm_engine
    engine.add_request(rid, {"prompt_token_ids": job["prompt"]}, params)
    for _ in range(int(job["abort_after_steps"])):
        engine.step()
    engine.abort_request([rid])
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    return {"id": rid, "aborted": True, "unfinished": engine.has_unfinished_requests()}


def main() -> None:
    config = json.loads(sys.argv[1])
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # vLLM's prints must not mix with the answers
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {
        "model": config["model"],
        "dtype": config.get("dtype", "float32"),
        "block_size": int(config.get("block_size", 32)),
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "max_model_len": int(config.get("max_model_len", 1024)),
        "max_num_batched_tokens": int(config.get("max_num_batched_tokens", 1024)),
        "enable_prefix_caching": bool(config.get("prefix_caching", False)),
        "seed": 0,
    }
    if config.get("chunked_prefill"):
        kwargs["enable_chunked_prefill"] = True
    if config.get("kv"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**config["kv"])
    llm = LLM(**kwargs)
    print(json.dumps({"ready": True}), file=real_stdout, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        rid = str(job["id"])
        params = SamplingParams(
            max_tokens=int(job.get("max_tokens", 16)),
            temperature=0.0,
            logprobs=1,
            detokenize=False,
        )
        if job.get("params") is not None:
            params.extra_args = {"kv_transfer_params": job["params"]}
        try:
            if job.get("abort_after_steps") is not None:
                answer = _abort(llm, rid, job, params)
            else:
                outs = llm.generate([{"prompt_token_ids": job["prompt"]}], params, use_tqdm=False)
                answer = _answer(outs[0], rid)
        except Exception as exc:  # reported to the test, which fails on it
            answer = {"id": rid, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), file=real_stdout, flush=True)


if __name__ == "__main__":
    main()

"""``python -m examples.reference_engine ROLE --master HOST:PORT [options]``

ROLE ``prefill``: compute each prompt through the connector (reusing what the pool holds,
saving every layer as it is computed) and print its first token. ``decode``: load each
prompt's KV from the pool layer by layer, compute the rest and print ``--max-new`` greedy
tokens. ``reference``: the same model in one process with transformers' own cache (no pool).
Prompts come from ``--prompts`` (a JSON list of token lists). One JSON line per prompt:
``{"tokens": [...], "loaded_tokens": n, "recomputed_from": null, "logits": [[...], ...]}``.

``--model`` is ``llama`` or ``qwen2`` (random weights from ``--seed``) or a local
checkpoint directory, whose pool namespace is the one vLLM's connector derives for it
(``--block-tokens`` and ``--quant`` as vLLM's ``kv_connector_extra_config``), so the two
engines share a pool: either may prefill what the other decodes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import kvclient

from . import Engine, Output, build_model, namespace, reference_generate
from .model import MODELS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.reference_engine")
    p.add_argument("role", choices=["prefill", "decode", "reference"])
    p.add_argument("--master", default="127.0.0.1:50051")
    p.add_argument(
        "--model",
        default="llama",
        help="llama | qwen2 (random weights from --seed) or a local checkpoint directory "
        "(shares its pool namespace with vLLM serving the same directory)",
    )
    p.add_argument("--block-tokens", type=int, default=16, help="the namespace's block_tokens")
    p.add_argument("--block-size", type=int, default=4, help="the engine's own page size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quant", default="int8", choices=["int8", "int4", "none"])
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--max-new", type=int, default=8)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument(
        "--stream",
        action="store_true",
        help="decode: the prompts are being prefilled now; load each layer as it lands",
    )
    args = p.parse_args(argv)
    if args.model not in MODELS and not os.path.isdir(args.model):
        p.error(f"--model must be one of {MODELS} or a checkpoint directory, got {args.model!r}")
    prompts = json.loads(args.prompts)
    if args.role == "reference":
        for prompt in prompts:
            _emit(reference_generate(args.model, prompt, args.max_new, args.seed))
        return 0
    ns = namespace(args.model, args.quant, args.seed, args.block_tokens)
    with kvclient.SyncKVClient.connect(args.master, ns, timeout_s=args.timeout) as kv:
        prefill = args.role == "prefill"
        model = build_model(args.model, args.seed)
        engine = Engine(model, kv, load=True, save=prefill, block_size=args.block_size)
        for prompt in prompts:
            if args.stream:  # tell whoever started us that the layers are awaited now
                params = {"kvstore": {"stream": True, "prompt_tokens": len(prompt)}}
                req = engine.schedule(prompt, args.max_new, params)
                print("reference_engine: streaming", flush=True, file=sys.stderr)
                _emit(engine.run(req))
            else:
                _emit(engine.generate(prompt, 1 if prefill else args.max_new))
    return 0


def _emit(out: Output) -> None:
    line = {
        "tokens": out.tokens,
        "loaded_tokens": out.loaded_tokens,
        "recomputed_from": out.recomputed_from,
        "params": out.params,
        "logits": [t.tolist() for t in out.logits],
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
